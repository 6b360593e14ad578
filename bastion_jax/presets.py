"""Named architectures (target + matching DFlash drafter) with random weights, for profiling.

Timing depends on shapes, not on weights, so `python -m bastion_jax.profile --arch qwen3-8b` needs
no download. The target shapes are the published configs (spec D.6 lists the three paper models);
drafters are the z-lab ones where the spec records them (A.1 Qwen3-8B, A.7 Llama-3.1-8B), else
the same recipe: target hidden size and heads, DFlash's default tap rule, block 16.

Weights are created on the device in the requested dtype by one jitted init, never as float32 on
the host first: an 8B model in float32 would not fit a GPU host's patience, let alone memory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from bastion_jax.config import RopeConfig, TargetConfig
from bastion_jax.dflash_config import DrafterConfig

if TYPE_CHECKING:  # JAX itself is imported where a model is built: `profile --help` lists PRESETS without it
    import jax.numpy as jnp
    from flax import nnx


class PresetError(ValueError):
    """An unknown architecture or an override it cannot take."""


@dataclasses.dataclass(frozen=True)
class Preset:
    target: TargetConfig
    drafter_layers: int
    block_size: int
    mask_token_id: int
    drafter_ffn: int | None = None  # default: the target's intermediate size
    num_taps: int | None = None  # default: one per drafter layer (z-lab)


_QWEN3_ROPE = RopeConfig(theta=1_000_000.0)
_LLAMA31_ROPE = RopeConfig(theta=500_000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_position_embeddings=8192)

PRESETS: dict[str, Preset] = {
    # Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16 (spec A.1): 5 layers, taps [1, 9, 17, 25, 33], mask 151669.
    "qwen3-8b": Preset(TargetConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, 1e-6, _QWEN3_ROPE,
                                    max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,)),
                       drafter_layers=5, block_size=16, mask_token_id=151669),
    # Qwen3-4B (tied embeddings) + z-lab/Qwen3-4B-DFlash-b16 (same recipe as the 8B one).
    "qwen3-4b": Preset(TargetConfig("qwen3", 151936, 2560, 9728, 36, 32, 8, 128, 1e-6, _QWEN3_ROPE,
                                    tie_word_embeddings=True, max_position_embeddings=40960,
                                    bos_token_id=151643, eos_token_ids=(151645,)),
                       drafter_layers=5, block_size=16, mask_token_id=151669),
    # Llama-3.1-8B-Instruct + z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat (spec A.7): block 10, taps
    # [1, 8, 15, 22, 29]; the mask id is a reserved special token (the spec could not read it).
    "llama3.1-8b": Preset(TargetConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, _LLAMA31_ROPE,
                                       max_position_embeddings=131072, bos_token_id=128000,
                                       eos_token_ids=(128001, 128008, 128009)),
                          drafter_layers=5, block_size=10, mask_token_id=128002),
    # SmolLM2-135M(-Instruct), the embedded default target; the drafter is train_drafter's default
    # (2 layers, 3 taps, mask = last vocab id).
    "smollm2-135m": Preset(TargetConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, RopeConfig(theta=100_000.0),
                                        tie_word_embeddings=True, max_position_embeddings=8192,
                                        bos_token_id=1, eos_token_ids=(2,)),
                           drafter_layers=2, block_size=16, mask_token_id=49151, num_taps=3),
}


def preset_configs(name: str, layers: int | None = None, drafter_layers: int | None = None,
                   block_size: int | None = None) -> tuple[TargetConfig, DrafterConfig]:
    """(target, drafter) configs of a named architecture; `layers` truncates the target (the
    drafter's taps follow), the other two override the drafter (small CI runs)."""
    if name not in PRESETS:
        raise PresetError(f"unknown architecture {name!r} (choose {', '.join(PRESETS)})")
    p = PRESETS[name]
    target = p.target
    if layers is not None:
        if not 1 <= layers <= target.num_hidden_layers:
            raise PresetError(f"--layers must be in [1, {target.num_hidden_layers}] for {name}, got {layers}")
        target = dataclasses.replace(target, num_hidden_layers=layers)
    n_drafter = p.drafter_layers if drafter_layers is None else drafter_layers
    if n_drafter < 1:
        raise PresetError(f"--drafter-layers must be >= 1, got {n_drafter}")
    block = p.block_size if block_size is None else block_size
    if block < 2:
        raise PresetError(f"--block-size must be >= 2, got {block}")
    drafter = DrafterConfig.for_target(target, num_layers=n_drafter, block_size=block, num_taps=p.num_taps,
                                       intermediate_size=p.drafter_ffn, mask_token_id=p.mask_token_id)
    drafter.check_pair(target)
    return target, drafter


def init_on_device(cfg: TargetConfig | DrafterConfig, dtype: jnp.dtype, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of a randomly initialised module, the parameters created by one jitted
    init on the default device directly in `dtype` (no host copy, no float32 detour)."""
    import jax
    from flax import nnx

    from bastion_jax.modeling.drafter import Drafter
    from bastion_jax.modeling.transformer import Transformer

    cls = Drafter if isinstance(cfg, DrafterConfig) else Transformer
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(seed))))
    # The stacked (scanned) twin is what gets initialised: one vmapped RNG program per parameter
    # kind, where unrolled layers make one per layer and weight (on an H100, Qwen3-8B's 36 unrolled
    # layers were not initialised after 110 s); unrolled layers then take their slices of it.
    stacked = dataclasses.replace(cfg, scan_layers=True)
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(cls(stacked, dtype=dtype, rngs=nnx.Rngs(seed)))))()
    if not cfg.scan_layers:
        params["layers"] = _unstack_freeing(params.pop("layers"))  # popped: the stack is freed leaf by leaf
    nnx.replace_by_pure_dict(state, params)
    return graphdef, state


def _unstack_freeing(layers: dict) -> dict[int, dict]:
    """Stacked `[num_layers, ...]` leaves -> `{i: layer i}`, the layout `checkpoints.params.unstack_layers`
    gives, but each stacked leaf dropped once sliced (this function owns the stack; that one leaves its
    input whole), so the weights are held about once, not twice (Qwen3-8B's layers: ~14 GiB in bf16)."""
    import jax

    leaves, treedef = jax.tree.flatten(layers)
    del layers
    n = leaves[0].shape[0]
    rows: list[list[jax.Array]] = [[] for _ in range(n)]
    while leaves:
        leaf = leaves.pop(0)
        for i in range(n):
            rows[i].append(leaf[i])
        del leaf
    return {i: jax.tree.unflatten(treedef, row) for i, row in enumerate(rows)}


def random_models(target_cfg: TargetConfig, drafter_cfg: DrafterConfig | None, dtype: jnp.dtype, seed: int = 0):
    """(Target, LoadedDrafter | None) with random weights; the Target has no tokenizer."""
    from bastion_jax.checkpoints import LoadedDrafter, Target

    graphdef, state = init_on_device(target_cfg, dtype, seed)
    target = Target(target_cfg, graphdef, state, tokenizer_dir=Path("."))
    drafter = None
    if drafter_cfg is not None:
        dgraph, dstate = init_on_device(drafter_cfg, dtype, seed + 1)
        drafter = LoadedDrafter(drafter_cfg, dgraph, dstate)
    return target, drafter


def tiny_drafter_config(target, num_layers: int = 1, block_size: int = 8, intermediate_size: int | None = None,
                        num_taps: int = 2):
    """A small DFlash drafter config that fits `target` (a TargetConfig): same hidden size and vocab.
    What `--drafter random` builds, and what the tests draft with."""
    cfg = DrafterConfig.for_target(target, num_layers=num_layers, block_size=block_size, num_taps=num_taps,
                                   intermediate_size=intermediate_size or 2 * target.hidden_size)
    from bastion_jax.checkpoints import layer_layout

    # laid out as the target it runs beside
    return layer_layout(cfg, target.scan_layers, feature_major=getattr(target, "feature_major", False))
