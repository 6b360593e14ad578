"""The DFlash drafter's config (`DrafterConfig`), parsed from a z-lab drafter `config.json`.

Every field a z-lab config can carry is honoured, knowingly irrelevant, or refused with a
`ConfigError` naming it (the table below). Frozen and hashable like `TargetConfig`, so it can be a
static argument of a jitted function.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from bastion_jax.config import ConfigError, RopeConfig, TargetConfig, check_full_attention


def round_up(n: int, multiple: int) -> int:
    return int(math.ceil(n / multiple) * multiple)


def _whole(name: str, value: Any, least: int | None = 1) -> int:
    """Field `name`'s value as a whole number (a JSON integer, not a float, string or boolean) of at least
    `least` (None: any): a z-lab config that says 16.9 or true is refused, not cut to 16 or read as 1."""
    if isinstance(value, bool) or not isinstance(value, int) or (least is not None and value < least):
        need = "a whole number" + (f" >= {least}" if least is not None else "")
        raise ConfigError(f"drafter config.json field {name} must be {need}, got {value!r}")
    return value


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's tap rule when a checkpoint names none: evenly spaced in [1, N-3] (Python round)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


# What a z-lab DFlash drafter config.json can say, and what we do with it. z-lab's `DFlashDraftModel`
# (dflash/model.py, z-lab/dflash @ 44947fb) is built from a transformers `Qwen3Config`, so absent fields
# take Qwen3Config's defaults; `dflash_config` is read as SGLang's DFlash loader reads it (below).
# Every field is honoured, knowingly irrelevant, or refused with a ConfigError naming it:
#
# honoured: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size,
#   num_key_value_heads (absent -> 32, null -> num_attention_heads: Qwen3Config), head_dim (absent -> 128:
#   Qwen3Config), rms_norm_eps, rope_theta / rope_scaling / rope_parameters (RopeConfig: default and
#   llama3, other rope types refused), attention_bias (q/k/v/o_proj biases, as Qwen3 attention),
#   hidden_act (DRAFTER_ACTIVATIONS; any other name refused), target_hidden_size (our own field),
#   block_size / target_layer_ids / mask_token_id / num_target_layers (`_dflash_field`),
#   layer_types / use_sliding_window / sliding_window / max_window_layers (`config.check_full_attention`:
#   every layer must resolve to full attention; a sliding_attention layer is refused, see there).
# refused when they would change the math: is_causal true (z-lab's drafter is never causal; SGLang
#   honours the field), any dflash_config key outside _DFLASH_KEYS (DFlash's own namespace: an unknown
#   key there is a semantic we do not know).
# irrelevant (read by nobody on the drafting path, so ignoring them changes nothing):
#   tie_word_embeddings (the drafter has no embedding or LM head of its own; it borrows the target's),
#   mlp_bias (Qwen3MLP has no biases whatever the config says; z-lab ignores it too),
#   max_position_embeddings (only dynamic/yarn RoPE reads it, and those are refused; llama3 carries
#   its own original_max_position_embeddings), attention_dropout (training only; inference runs with
#   0), bos/eos/pad_token_id (the drafter never starts or stops a sequence; the target's ids are used),
#   dflash_config.mask_token (SGLang's tokenizer string for the mask; we require mask_token_id),
#   initializer_range, use_cache, torch_dtype/dtype (the loader reads the tensors' dtype),
#   architectures, auto_map, model_type, transformers_version, _name_or_path, and any other top-level
#   key (Qwen3Config keeps unknown keys as attributes that DFlashDraftModel never reads).
DRAFTER_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
_DFLASH_KEYS = ("block_size", "target_layer_ids", "mask_token_id", "num_target_layers", "mask_token", "is_causal")
# Why a sliding drafter layer is refused: z-lab's `Qwen3DFlashAttention` passes the window to the
# attention kernel with no mask: under flash-attention it becomes a symmetric band |i - j| <
# sliding_window over [context | block], while under SDPA/eager (z-lab's documented fallback) it is
# ignored; SGLang's DFlash model makes sliding layers causal by default; SpecForge's training masks
# anchor the window differently again. With no agreed meaning, it is refused rather than guessed.
DRAFTER_SLIDING_WHY = "DFlash implementations disagree on which keys they see"


def _dflash_field(hf: dict[str, Any], name: str) -> Any:
    """`dflash_config[name]`, else top-level `name`, else None; refuses the two spelled differently.

    z-lab's own model.py reads `block_size` and `num_target_layers` only at the top level and
    `target_layer_ids` / `mask_token_id` only inside `dflash_config`; SGLang's DFlash loader
    (`dflash_utils.resolve_dflash_block_size`, `parse_dflash_draft_config`) prefers `dflash_config`
    and falls back to the top level, which is how newer (Qwen3.5+) drafters place `block_size`. Where
    the two places agree or only one is set every reader gets the same value; a conflicting pair would
    be read differently by the two, so it is refused rather than resolved by a guess."""
    inner, outer = (hf.get("dflash_config") or {}).get(name), hf.get(name)
    if inner is not None and outer is not None and inner != outer:
        raise ConfigError(f"drafter config.json sets {name}={outer!r} at top level but dflash_config.{name}="
                          f"{inner!r} (z-lab's model.py and SGLang would read different values); keep one")
    return inner if inner is not None else outer


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash block-diffusion drafter (z-lab checkpoint format, Qwen3-style layers)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    attention_bias: bool = False  # q/k/v/o_proj carry biases (Qwen3 attention with attention_bias)
    hidden_act: str = "silu"  # MLP activation, one of DRAFTER_ACTIVATIONS (HF ACT2FN names)
    # How the layers run, not a property of the checkpoint (never in config.json): one stacked module
    # under a scan or unrolled, as the target's (`TargetConfig.scan_layers`; `load_drafter` follows
    # the target's layout unless told otherwise).
    scan_layers: bool = False
    # Likewise: products taken feature-major (`layers.project`), as the target's
    # (`TargetConfig.feature_major`; `load_drafter` follows it).
    feature_major: bool = False
    # Rank of the optional parent-conditioned output head (`modeling/cond_head.py`; 0: none). Not a
    # z-lab field: it comes from `cond_head.json` beside the checkpoint (`checkpoints/cond_head.py`).
    cond_head_rank: int = 0
    # Whether that head carries a state from slot to slot (`rec`: each slot given every drafted token
    # before it, not only the last); likewise from `cond_head.json`.
    cond_head_recurrent: bool = False

    @property
    def head_words(self) -> str:
        """The conditioned head in words, for logs and reports ("" without one)."""
        if not self.cond_head_rank:
            return ""
        return f"{'recurrent ' if self.cond_head_recurrent else ''}conditioned head of rank {self.cond_head_rank}"

    @classmethod
    def from_hf(cls, hf: dict[str, Any], target: TargetConfig | None = None) -> "DrafterConfig":
        """Parse a z-lab config.json (see the field list above); `target` supplies defaults the file may omit."""
        dflash = hf.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ConfigError(f"drafter config.json field dflash_config must be an object, got {dflash!r}")
        unknown = sorted(set(dflash) - set(_DFLASH_KEYS))
        if unknown:
            raise ConfigError(f"unknown drafter config.json field dflash_config.{unknown[0]} "
                              f"(known: {', '.join(_DFLASH_KEYS)})")
        if _dflash_field(hf, "is_causal"):
            raise ConfigError("drafter config.json sets is_causal=true: a causal DFlash drafter is not supported "
                              "(z-lab's drafter attends bidirectionally within the block)")
        act = hf.get("hidden_act", "silu")
        if act not in DRAFTER_ACTIVATIONS:
            raise ConfigError(f"unsupported drafter hidden_act {act!r} (supported: {', '.join(DRAFTER_ACTIVATIONS)})")
        try:
            heads = _whole("num_attention_heads", hf["num_attention_heads"])
            hidden = _whole("hidden_size", hf["hidden_size"])
            n_layers = _whole("num_hidden_layers", hf["num_hidden_layers"])
            check_full_attention(hf, n_layers, "drafter", DRAFTER_SLIDING_WHY)
            n_target = _dflash_field(hf, "num_target_layers")
            if n_target is not None:
                n_target = _whole("num_target_layers", n_target)
            elif target is not None:
                n_target = target.num_hidden_layers
            if n_target is None:
                raise KeyError("num_target_layers")
            taps = _dflash_field(hf, "target_layer_ids")
            if taps is not None and not (isinstance(taps, list) and taps):
                raise ConfigError(f"drafter config.json field target_layer_ids must be a non-empty list, got {taps!r}")
            taps = (tuple(_whole("target_layer_ids", t, None) for t in taps) if taps
                    else default_target_layer_ids(n_target, n_layers))
            block = _dflash_field(hf, "block_size")
            if block is None:
                raise KeyError("block_size")
            mask = _dflash_field(hf, "mask_token_id")
            if mask is None:
                raise KeyError("dflash_config.mask_token_id")
            kv_heads = hf.get("num_key_value_heads", 32)  # Qwen3Config: absent -> 32, null -> num_attention_heads
            width = hf.get("target_hidden_size")
            bias = hf.get("attention_bias", False)
            if not isinstance(bias, bool):
                raise ConfigError(f"drafter config.json field attention_bias must be true or false, got {bias!r}")
            cfg = cls(
                hidden_size=hidden,
                intermediate_size=_whole("intermediate_size", hf["intermediate_size"]),
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                num_key_value_heads=heads if kv_heads is None else _whole("num_key_value_heads", kv_heads, 0),
                # absent: Qwen3Config's default, not hidden // heads
                head_dim=_whole("head_dim", hf["head_dim"]) if "head_dim" in hf else 128,
                vocab_size=_whole("vocab_size", hf["vocab_size"]),
                block_size=_whole("block_size", block, 0),
                mask_token_id=_whole("mask_token_id", mask, 0),
                target_layer_ids=taps,
                num_target_layers=n_target,
                target_hidden_size=(_whole("target_hidden_size", width) if width is not None
                                    else (target.hidden_size if target else hidden)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_hf(hf),
                attention_bias=bias,
                hidden_act=act,
            )
        except KeyError as e:
            raise ConfigError(f"drafter config.json is missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"malformed drafter config.json field: {e}") from None
        if cfg.num_key_value_heads <= 0 or cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(f"drafter num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads={cfg.num_key_value_heads}"
                              + ("" if "num_key_value_heads" in hf else " (Qwen3Config's default when absent)"))
        return cfg

    @classmethod
    def for_target(cls, target: TargetConfig, *, num_layers: int, block_size: int, num_taps: int | None = None,
                   intermediate_size: int | None = None, mask_token_id: int | None = None) -> "DrafterConfig":
        """A new drafter shaped to read `target` (its width, heads, vocab, RoPE), for training or profiling.

        Taps follow DFlash's rule with `num_taps` (default: one per drafter layer); targets under 4
        layers (truncated test models) tap their first layers. The mask token defaults to the last id.
        """
        n = target.num_hidden_layers
        k = num_taps or num_layers
        taps = default_target_layer_ids(n, k) if n >= 4 else tuple(range(min(k, n)))
        return cls(
            hidden_size=target.hidden_size, intermediate_size=intermediate_size or target.intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim, vocab_size=target.vocab_size,
            block_size=block_size, mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
            target_layer_ids=taps, num_target_layers=n, target_hidden_size=target.hidden_size,
            rms_norm_eps=target.rms_norm_eps, rope=target.rope)

    def to_hf(self) -> dict[str, Any]:
        """z-lab format config.json (what `from_hf` reads back identically). `block_size` sits at the
        top level, the one place z-lab's model.py reads it."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": None if self.rope.rope_type == "default" else self.rope.to_hf(),
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "target_hidden_size": self.target_hidden_size,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
        }

    def check_pair(self, target: TargetConfig) -> None:
        """Raise one clear error if this drafter cannot read `target`'s features and vocabulary."""
        def bad(what: str, mine: Any, theirs: Any) -> ConfigError:
            return ConfigError(f"drafter/target mismatch: {what}: drafter {mine} vs target {theirs}")

        if self.hidden_size != target.hidden_size:
            raise bad("hidden_size", self.hidden_size, target.hidden_size)
        if self.target_hidden_size != target.hidden_size:
            raise bad("feature width (target_hidden_size)", self.target_hidden_size, target.hidden_size)
        if self.vocab_size != target.vocab_size:
            raise bad("vocab_size", self.vocab_size, target.vocab_size)
        if self.num_target_layers != target.num_hidden_layers:
            raise bad("num_target_layers", self.num_target_layers, target.num_hidden_layers)
        bad_taps = [t for t in self.target_layer_ids if not 0 <= t < target.num_hidden_layers]
        if bad_taps:
            raise bad("target_layer_ids", list(self.target_layer_ids),
                      f"{target.num_hidden_layers} layers (ids must be in [0, {target.num_hidden_layers}))")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise bad("mask_token_id", self.mask_token_id, f"vocab of {target.vocab_size}")
        if self.block_size < 2:
            raise ConfigError(f"drafter block_size must be >= 2, got {self.block_size}")
