"""Model configs as frozen dataclasses, parsed from Hugging Face `config.json`.

Frozen (hashable) so a config can be a static argument of a jitted function: two models with the
same shapes share compiled code, and a config change can never silently reuse a stale compilation.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_TARGET_TYPES = ("llama", "qwen3")


class ConfigError(ValueError):
    """A config.json that does not describe a model we can run."""


def check_full_attention(hf: dict[str, Any], n_layers: int, model: str = "target",
                         why: str = "every layer here attends to the whole context") -> None:
    """Refuse a config with a sliding-window layer, resolving `layer_types` as Qwen3Config does:
    `sliding_window` counts only when `use_sliding_window` (default false), and absent `layer_types`
    become sliding for layer index >= `max_window_layers` (default 28) when a window is set. Our
    attention is full over the context, so a sliding layer would silently see keys the model never
    saw; `why` says so in the error (`model`: "target" or "drafter")."""
    use_sliding = hf.get("use_sliding_window", False)
    window = hf.get("sliding_window", 4096) if use_sliding else None
    types = hf.get("layer_types")
    if types is None:
        first = int(hf.get("max_window_layers", 28))
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise ConfigError(f"{model} config.json field layer_types must list one type per layer "
                          f"({n_layers}), got {types!r}")
    for i, kind in enumerate(types):
        if kind == "sliding_attention":
            raise ConfigError(
                f"{model} layer {i} is sliding_attention (layer_types; use_sliding_window={use_sliding}, "
                f"sliding_window={hf.get('sliding_window')}): sliding-window {model} layers are not supported "
                f"({why})")
        if kind != "full_attention":
            raise ConfigError(f"unsupported {model} layer type layer_types[{i}]={kind!r} (only full_attention)")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` is "default" or "llama3" (HF names)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "RopeConfig":
        # transformers >= 5 stores everything in `rope_parameters`; older files use
        # `rope_theta` + `rope_scaling`. Accept both.
        params = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        params = {**scaling, **params}
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type == "default":
            return cls(theta=theta)
        if rope_type == "llama3":
            return cls(
                theta=theta,
                rope_type="llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        raise ConfigError(f"unsupported rope type {rope_type!r} (supported: default, llama3)")

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_theta": self.theta, "rope_type": self.rope_type}
        if self.rope_type == "llama3":
            out.update(
                factor=self.factor,
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return out


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A decoder-only target LLM (Llama-3.x or Qwen3 family)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # How the decoder layers run, not a property of the checkpoint (never in config.json): one stacked
    # module under a scan (compiles once whatever the depth) or unrolled, the default (XLA copies
    # each layer's weight slice out of a stack before its matmuls, on CPU and GPU alike).
    # `checkpoints.layer_layout` applies `default_scan_layers` unless told.
    scan_layers: bool = False
    # Likewise not in config.json: the decoder layers' linear weights held [in, out] instead of HF's
    # [out, in] (`Linear(in_out=True)`): XLA:CPU multiplies a few rows (a tree) ~1.5x faster that
    # way. Checkpoints stay in HF layout; `checkpoints.layer_layout` picks it per backend.
    weights_in_out: bool = False
    # Likewise: the products of the layers' [out, in] weights (and the LM head) taken feature-major,
    # W @ x^T (`layers.project`), faster on CPUs whose matmul kernel wastes a few rows' tiles (AVX2
    # EPYC: a 4-row forward 1.5x faster). Float32 on CPU only; never with `weights_in_out`.
    feature_major: bool = False

    @property
    def layers_layout(self) -> str:
        """"scanned" or "unrolled": how reports and calibration keys name `scan_layers`."""
        return "scanned" if self.scan_layers else "unrolled"

    @property
    def weights_layout(self) -> str:
        """"in-out", "out-in" or "feature-major" (`checkpoints.layout_probe.LAYOUTS`): how reports and
        calibration keys name `weights_in_out` / `feature_major`."""
        return "in-out" if self.weights_in_out else "feature-major" if self.feature_major else "out-in"

    @property
    def qk_norm(self) -> bool:
        """Qwen3 RMS-normalises each head of Q and K before RoPE; Llama does not."""
        return self.model_type == "qwen3"

    @property
    def num_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "TargetConfig":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_TARGET_TYPES:
            raise ConfigError(
                f"unknown architecture model_type={model_type!r} "
                f"(supported: {', '.join(SUPPORTED_TARGET_TYPES)})"
            )
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            eos = hf.get("eos_token_id")
            eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
            cfg = cls(
                model_type=model_type,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_hidden_layers=int(hf["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_hf(hf),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", False)),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
                pad_token_id=hf.get("pad_token_id"),
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"malformed config.json field: {e}") from None
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim")
        for name in sizes:
            if getattr(cfg, name) <= 0:
                raise ConfigError(f"config.json field {name} must be positive, got {getattr(cfg, name)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {hf['hidden_act']!r} (only silu)")
        check_full_attention(hf, cfg.num_hidden_layers)
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_key_value_heads}"
            )
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """An HF-style config.json dict that `from_hf` reads back identically."""
        return {
            "model_type": self.model_type,
            "architectures": [
                {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.model_type]
            ],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": self.rope.to_hf(),
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
        }

    def param_count(self) -> int:
        h, q, kv, f = (
            self.hidden_size,
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
            self.intermediate_size,
        )
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h


def read_config_json(path: str | Path) -> dict[str, Any]:
    """Read a config.json with a one-line error for a missing or corrupt file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"corrupt config.json at {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"corrupt config.json at {path}: expected a JSON object")
    return data
