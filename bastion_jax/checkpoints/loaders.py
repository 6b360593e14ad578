"""bastion_jax checkpoint format and model loading.

A converted checkpoint is a directory: `config.json` (HF-style, plus a `bastion_jax` block naming
the format and dtype), `params/` (an orbax StandardCheckpointer tree in our NNX state layout) and
the tokenizer files. `load_target` also accepts an HF directory or a GGUF file directly and
converts it in memory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from bastion_jax.checkpoints.cond_head import default_cond_head, has_head, read_head, remove_head, write_head
from bastion_jax.checkpoints.params import match_layout, swap_dense, unstack_layers
from bastion_jax.config import ConfigError, TargetConfig, read_config_json
from bastion_jax.dflash_config import DrafterConfig
from bastion_jax.modeling.drafter import Drafter
from bastion_jax.modeling.transformer import Transformer

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not fit the model."""


@dataclasses.dataclass
class Target:
    """A loaded target: split once (graphdef + state) so jitted code takes `state` as an argument."""

    config: TargetConfig
    graphdef: nnx.GraphDef
    state: nnx.State
    tokenizer_dir: Path  # where AutoTokenizer.from_pretrained finds the tokenizer
    tokenizer_gguf: str | None = None  # GGUF file name inside tokenizer_dir, if the tokenizer lives there
    path: Path | None = None

    @property
    def dtype(self) -> jnp.dtype:
        return self.state["embed_tokens"]["weight"][...].dtype


@dataclasses.dataclass
class LoadedDrafter:
    """A loaded DFlash drafter, split once like `Target`."""

    config: DrafterConfig
    graphdef: nnx.GraphDef
    state: nnx.State
    path: Path | None = None


def _module(cfg: TargetConfig | DrafterConfig, dtype: jnp.dtype, seed: int = 0):
    cls = Drafter if isinstance(cfg, DrafterConfig) else Transformer
    return cls(cfg, dtype=dtype, rngs=nnx.Rngs(seed))


@functools.lru_cache(maxsize=32)
def _abstract(cfg: TargetConfig | DrafterConfig, dtype: jnp.dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The module's graph and parameter shapes, traced once per config and dtype. Why cached: tracing
    the construction (`nnx.eval_shape`) takes ~1 s for SmolLM2's 272 parameters, growing with the square
    of their count (each parameter's `sharding` probe of its tracer builds an error message over the
    whole trace so far), and a load asked for it twice (the restore's target shapes, then the merge)."""
    return nnx.split(nnx.eval_shape(lambda: _module(cfg, dtype)))


def abstract_state(cfg: TargetConfig | DrafterConfig, dtype: jnp.dtype) -> nnx.State:
    """Every parameter's shape and dtype (`jax.ShapeDtypeStruct` leaves), as a fresh `State` the caller
    may fill in place."""
    return jax.tree.map(lambda x: x, _abstract(cfg, jnp.dtype(dtype))[1])


def abstract_target_state(cfg: TargetConfig, dtype: jnp.dtype) -> nnx.State:
    return abstract_state(cfg, dtype)


def random_target(cfg: TargetConfig, dtype: jnp.dtype = jnp.float32, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """A randomly initialised target (tests, profiling at named shapes)."""
    return nnx.split(_module(cfg, dtype, seed))


def random_drafter(cfg: DrafterConfig, dtype: jnp.dtype = jnp.float32, seed: int = 0) -> LoadedDrafter:
    """A randomly initialised drafter (tests, the CLI's tiny random drafter)."""
    graphdef, state = nnx.split(_module(cfg, dtype, seed))
    return LoadedDrafter(cfg, graphdef, state)


def _save(out: Path, hf: dict[str, Any], kind: str, params: dict[str, Any], source: str) -> None:
    import orbax.checkpoint as ocp

    dtype = jax.tree.leaves(params)[0].dtype
    hf = dict(hf, bastion_jax={"format": FORMAT_VERSION, "kind": kind, "dtype": jnp.dtype(dtype).name,
                               "source": source})
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save((out / "params").absolute(), unstack_layers(params))  # stored per layer, as HF names them
    ckptr.wait_until_finished()


def save_target(out: Path, cfg: TargetConfig, params: dict[str, Any], source: str = "") -> None:
    _save(out, cfg.to_hf(), "target", swap_dense(params) if cfg.weights_in_out else params, source)


def save_drafter(out: Path, cfg: DrafterConfig, params: dict[str, Any], source: str = "") -> None:
    """Our format; a conditioned head goes beside it in its own files, as beside a z-lab checkpoint."""
    params = dict(params)
    head = params.pop("cond_head", None)
    _save(out, cfg.to_hf(), "drafter", params, source)
    if head is not None:
        write_head(out, head, jax.tree.leaves(head)[0].dtype, drafter=params)
    else:
        remove_head(out)


def _merge(cfg, dtype: jnp.dtype, params: dict[str, Any]) -> tuple[nnx.GraphDef, nnx.State]:
    graphdef, state = _abstract(cfg, jnp.dtype(dtype))[0], abstract_state(cfg, dtype)
    params = match_layout(params, nnx.to_pure_dict(state))
    if getattr(cfg, "weights_in_out", False):  # checkpoints are in HF layout
        params = swap_dense(params)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, dtype), params))
    return graphdef, state


def _stored_dtype(hf: dict[str, Any]) -> jnp.dtype | None:
    """The dtype a converted checkpoint's config.json names (None if it names none it can read:
    `_restore` then says what is wrong)."""
    meta = hf.get("bastion_jax")
    name = meta.get("dtype") if isinstance(meta, dict) else None
    try:
        return None if name is None else jnp.dtype(name)  # numpy would read None as float64
    except TypeError:
        return None


def _restore(path: Path, hf: dict[str, Any], kind: str, cfg, dtype: jnp.dtype | None):
    import orbax.checkpoint as ocp

    meta = hf["bastion_jax"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or meta.get("kind") != kind:
        found = meta.get("kind") if isinstance(meta, dict) else meta
        raise CheckpointError(f"{path} is not a bastion_jax {kind} checkpoint (found {found!r})")
    stored = _stored_dtype(hf)
    if stored is None:
        if meta.get("dtype") is None:
            raise CheckpointError(f"{path}/config.json names no dtype for its weights (bastion_jax.dtype)")
        raise CheckpointError(f"{path}/config.json names an unknown dtype {meta.get('dtype')!r}")
    target_tree = unstack_layers(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                                              nnx.to_pure_dict(abstract_state(cfg, stored))))
    if getattr(cfg, "weights_in_out", False):  # stored in HF layout
        target_tree = swap_dense(target_tree)
    if not (path / "params").is_dir():
        raise CheckpointError(f"missing params/ directory in checkpoint {path}")
    params_dir = (path / "params").absolute()
    restored_whole = _quiet_abandoned_reads(params_dir)  # before the restore: its reads may outlive its failure
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(params_dir, target_tree)
    except Exception as e:  # orbax raises many types for truncated/corrupt trees
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"corrupt or incompatible checkpoint {path / 'params'}: {msg}") from None
    restored_whole()  # no read was abandoned: the hook and the logger go back as they were
    return _merge(cfg, dtype or stored, params)


class _UnretrievedReads(logging.Filter):
    """Drops asyncio's "... exception was never retrieved" reports that name one of `dirs`."""

    def __init__(self):
        super().__init__()
        self.dirs: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        return not ("exception was never retrieved" in text and any(d in text for d in self.dirs))


_UNRETRIEVED = _UnretrievedReads()


def _quiet_abandoned_reads(params_dir: Path) -> Callable[[], None]:
    """Silence what a failed restore's abandoned reads print; returns what undoes it after a success.

    Orbax gives up at the first array it cannot read (a truncated file), closes its event loop and
    returns; reads still in flight finish afterwards and surface two ways. Their callbacks find the
    loop closed, which Python reports as an unraisable "Event loop is closed" (a truncated 135M
    checkpoint printed up to a dozen tracebacks after the one-line error, some at interpreter exit);
    and a read that failed is a future nobody awaits, whose exception asyncio logs when it is
    collected (CI printed 39 such lines). Installed before a restore (a callback can fire before the
    failure reaches us) and left in place only when it fails. Only those reports are dropped: the
    unraisable hook passes every other error to the hook installed before (it is installed once,
    never wrapped twice), and one shared filter on the asyncio logger drops only reports that name a
    failed checkpoint's params directory."""
    previous = sys.unraisablehook
    if not getattr(previous, "_bastion_quiet", False):

        def hook(unraisable) -> None:
            exc = unraisable.exc_value
            if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
                previous(unraisable)

        hook._bastion_quiet = True
        sys.unraisablehook = hook
    name = str(params_dir)
    fresh = name not in _UNRETRIEVED.dirs
    _UNRETRIEVED.dirs.add(name)
    logging.getLogger("asyncio").addFilter(_UNRETRIEVED)  # a filter already there is not added again

    def undo() -> None:
        if sys.unraisablehook is not previous:
            sys.unraisablehook = previous
        if fresh:
            _UNRETRIEVED.dirs.discard(name)
        if not _UNRETRIEVED.dirs:
            logging.getLogger("asyncio").removeFilter(_UNRETRIEVED)

    return undo


def default_scan_layers() -> bool:
    """Unrolled layers on every backend. A scan compiles one layer body however deep the model, but
    XLA copies each layer's weight slice out of the stacked parameters before its matmuls: on CPU
    1-token steps ran 10-18% slower; on an H100 (2026-11-27, Qwen3-8B shapes, bf16) the scanned AR
    step's optimised HLO copies q/o/gate/up/down of every layer per step (an async dynamic-slice
    fusion each), about 3x the HBM floor's weight traffic, and the step took 17.6-18.0 ms with the
    Pallas prefix kernel (19.7-28.9 ms with the XLA loop) against a 5.3 ms floor. Scanned layers stay
    a choice (`scan_layers=True`) where compile time matters more."""
    return False


def default_weights_layout(cfg: TargetConfig | None = None, dtype: jnp.dtype | None = None) -> str:
    """How the layers' linear weights are held and multiplied, one of `layout_probe.LAYOUTS`:
    "in-out" ([in, out]), "out-in" (HF's [out, in]) or "feature-major" ([out, in], products W @ x^T).
    Off CPU HF's (GPU matmul libraries take either layout at full speed). On CPU, which one XLA:CPU
    multiplies a verify step's few rows by fastest depends on the machine (10-40% of a tree step),
    so with `cfg` it is measured once per machine (`layout_probe.best_layout`, cached;
    `$BASTION_WEIGHTS_LAYOUT` pins it); without `cfg`, [in, out]."""
    if jax.default_backend() != "cpu":
        return "out-in"
    if cfg is None:
        return "in-out"
    from bastion_jax.checkpoints.layout_probe import best_layout

    return best_layout(cfg, dtype)


def layer_layout(cfg: TargetConfig | DrafterConfig, scan_layers: bool | None = None,
                 weights_in_out: bool | None = None, dtype: jnp.dtype | None = None,
                 feature_major: bool | None = None):
    """`cfg` with its layers scanned or unrolled (`scan_layers`, None: `default_scan_layers()`) and its
    products' form. For a target: its layers' linear weights [in, out] or HF's [out, in]
    (`weights_in_out`) and, with [out, in], multiplied feature-major or not (`feature_major`); both
    None: `default_weights_layout(cfg, dtype)` (`dtype` is the one the target computes in); one
    given, the other is off unless given. A drafter's weights stay [out, in]; `feature_major` (None:
    off) as its target's, since both run in the same steps."""
    scan = default_scan_layers() if scan_layers is None else scan_layers
    if isinstance(cfg, DrafterConfig):
        return dataclasses.replace(cfg, scan_layers=scan, feature_major=bool(feature_major))
    if weights_in_out is None and feature_major is None:
        from bastion_jax.checkpoints.layout_probe import LAYOUTS

        weights_in_out, feature_major = LAYOUTS[default_weights_layout(cfg, dtype)]
    weights_in_out, feature_major = bool(weights_in_out), bool(feature_major)
    if weights_in_out and feature_major:
        raise ConfigError("feature_major products take the weights' [out, in] layout: not with weights_in_out")
    return dataclasses.replace(cfg, scan_layers=scan, weights_in_out=weights_in_out, feature_major=feature_major)


def load_target(path: str | Path, dtype: jnp.dtype | None = None, scan_layers: bool | None = None,
                weights_in_out: bool | None = None, feature_major: bool | None = None) -> Target:
    """Load a converted checkpoint dir, an HF safetensors dir, or a .gguf file.

    `dtype` casts the parameters. None keeps the checkpoint's own dtype: the stored one of a
    converted checkpoint; an HF dir's `torch_dtype`/`dtype` (else its safetensors' dtype); a GGUF
    file's float type, or float32 when its tensors are quantised (they are dequantised to float32).
    Nothing is upcast silently. `scan_layers`: run the decoder layers under a scan (stacked
    parameters and KV cache) or unrolled; `weights_in_out`: hold the layers' linear weights
    [in, out]; `feature_major`: multiply HF's [out, in] ones feature-major (`layers.project`); None
    picks unrolled layers (`default_scan_layers`) and the weights' layout by backend and, on CPU, by
    what the machine runs fastest (`default_weights_layout`; see `layer_layout`).
    """
    from bastion_jax.checkpoints import ConversionError, load_params, open_source

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        if path.is_dir() and (path / "config.json").is_file():
            hf = read_config_json(path / "config.json")
            if "bastion_jax" in hf:
                cfg = layer_layout(TargetConfig.from_hf(hf), scan_layers, weights_in_out,
                                   dtype or _stored_dtype(hf), feature_major)
                graphdef, state = _restore(path, hf, "target", cfg, dtype)
                return Target(cfg, graphdef, state, tokenizer_dir=path, path=path)
        source = open_source(path)
        dtype = dtype or source.native_dtype()
        cfg, params = load_params(source, dtype)
        cfg = layer_layout(cfg, scan_layers, weights_in_out, dtype, feature_major)
    except (ConversionError, ConfigError) as e:
        raise CheckpointError(str(e)) from None
    graphdef, state = _merge(cfg, dtype, params)
    if path.is_file():
        return Target(cfg, graphdef, state, tokenizer_dir=path.parent, tokenizer_gguf=path.name, path=path)
    return Target(cfg, graphdef, state, tokenizer_dir=path, path=path)


def load_drafter(path: str | Path, target: TargetConfig, dtype: jnp.dtype | None = None,
                 scan_layers: bool | None = None, cond_head: bool | None = None) -> LoadedDrafter:
    """Load a converted drafter or a z-lab DFlash checkpoint dir; checks it fits `target`. `dtype`
    as in `load_target` (None: the checkpoint's own); `generate` passes the target's dtype on purpose,
    since the drafter reads the target's features and shares its LM head. `scan_layers`: run its
    layers under a scan (stacked parameters) or unrolled; None follows `target.scan_layers`, since
    both run inside the same steps (the trainer asks for unrolled layers); its products' form
    follows `target.feature_major` likewise. `cond_head`: load the conditioned head shipped beside
    the checkpoint, if any (`checkpoints/cond_head.py`); False drafts with the plain drafter; None:
    `default_cond_head()` (on)."""
    from bastion_jax.checkpoints import ConversionError
    from bastion_jax.checkpoints.dflash import load_zlab_params

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"drafter checkpoint not found (expected a directory): {path}")
    try:
        hf = read_config_json(path / "config.json")
        cfg = DrafterConfig.from_hf(hf, target)
        cfg.check_pair(target)
        cfg = layer_layout(cfg, target.scan_layers if scan_layers is None else scan_layers,
                           feature_major=target.feature_major)
        if "bastion_jax" in hf:
            graphdef, state = _restore(path, hf, "drafter", cfg, dtype)
        else:
            from bastion_jax.checkpoints.hf import open_hf

            dtype = dtype or open_hf(path).native_dtype()
            _, params = load_zlab_params(path, dtype, target)
            graphdef, state = _merge(cfg, dtype, params)
        if cond_head is None:
            cond_head = default_cond_head()
        if cond_head and has_head(path):
            base = nnx.to_pure_dict(state)
            rank, head = read_head(path, cfg.hidden_size, base)
            cfg = dataclasses.replace(cfg, cond_head_rank=rank, cond_head_recurrent="rec" in head)
            dtype = jax.tree.leaves(state)[0].dtype
            graphdef, state = _merge(cfg, dtype, {**base, "cond_head": head})
    except (ConversionError, ConfigError) as e:
        raise CheckpointError(str(e)) from None
    return LoadedDrafter(cfg, graphdef, state, path)
