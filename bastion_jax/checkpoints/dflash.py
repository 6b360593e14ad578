"""z-lab DFlash drafter checkpoints: config.json + safetensors with keys `fc.weight`, `layers.i...`.

Keys may carry a `model.` prefix (both spellings exist in the wild); `build_params` strips it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bastion_jax.config import ConfigError, TargetConfig
from bastion_jax.dflash_config import DrafterConfig
from bastion_jax.checkpoints.errors import ConversionError
from bastion_jax.checkpoints.params import build_params, path_to_name, unstack_layers


def is_dflash_config(hf: dict[str, Any]) -> bool:
    return "dflash_config" in hf or "DFlashDraftModel" in (hf.get("architectures") or [])


def load_zlab_params(path: Path, dtype: jnp.dtype, target: TargetConfig | None = None
                     ) -> tuple[DrafterConfig, dict[str, Any]]:
    from bastion_jax.checkpoints import abstract_state
    from bastion_jax.checkpoints.hf import open_hf

    source = open_hf(Path(path))
    try:
        cfg = DrafterConfig.from_hf(source.hf_config, target)
    except ConfigError as e:
        raise ConversionError(f"{path}: {e}") from None
    return cfg, build_params(source, abstract_state(cfg, dtype), dtype)


def export_zlab(cfg: DrafterConfig, state: nnx.State, out: str | Path, dtype: jnp.dtype = jnp.bfloat16,
                info: dict[str, Any] | None = None) -> Path:
    """Write a drafter as z-lab config.json + model.safetensors (what `load_drafter` reads back), and
    its conditioned head, if it has one, as cond_head.json (with `info`) + cond_head.safetensors."""
    from safetensors.numpy import save_file

    from bastion_jax.checkpoints.cond_head import remove_head, write_head

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pure = nnx.to_pure_dict(state)
    head = pure.pop("cond_head", None)  # not a z-lab tensor: its own files beside the checkpoint
    if head is not None:
        write_head(out, head, dtype, info, drafter=pure)
    else:
        remove_head(out)
    flat = jax.tree_util.tree_flatten_with_path(unstack_layers(pure))[0]  # per layer, as z-lab names them
    tensors = {path_to_name(tuple(getattr(k, "key", k) for k in kp)): np.asarray(jnp.asarray(v, dtype))
               for kp, v in flat}
    save_file(tensors, str(out / "model.safetensors"))
    hf = cfg.to_hf()
    hf["torch_dtype"] = jnp.dtype(dtype).name
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    return out
