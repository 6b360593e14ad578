"""Source checkpoint -> validated params -> orbax checkpoint + config + tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp

from bastion_jax.config import ConfigError, TargetConfig
from bastion_jax.checkpoints.errors import ConversionError
from bastion_jax.checkpoints.params import build_params
from bastion_jax.checkpoints.source import Source, open_source

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "f32": jnp.float32, "bf16": jnp.bfloat16}


def parse_dtype(name: str | None) -> jnp.dtype | None:
    """A dtype name; None stays None (keep the checkpoint's own dtype)."""
    if name is None:
        return None
    try:
        return DTYPES[name]
    except KeyError:
        raise ConversionError(f"unknown dtype {name!r} (choose float32 or bfloat16)") from None


def load_params(source: Source, dtype: jnp.dtype | None) -> tuple[TargetConfig, dict[str, Any]]:
    """Config and nested param dict of a target checkpoint, validated against the model, in `dtype`
    (None: the checkpoint's own dtype, `Source.native_dtype`)."""
    from bastion_jax.checkpoints import abstract_target_state

    try:
        cfg = TargetConfig.from_hf(source.hf_config)
    except ConfigError as e:
        raise ConversionError(f"{source.path}: {e}") from None
    dtype = dtype or source.native_dtype()
    return cfg, build_params(source, abstract_target_state(cfg, dtype), dtype)


def _copy_companions(src: Path, out: Path) -> None:
    """The files a drafter reads from its own directory besides its weights (the token ranking of
    `--draft-vocab auto`, the datastore of `--datastore auto`): left behind, the converted drafter
    would draft over the whole vocabulary without a datastore, slower with no word said."""
    import shutil

    from bastion_jax.datastore import FILE as DATASTORE_FILE
    from bastion_jax.speculative import RANKING_FILE

    for name in (RANKING_FILE, DATASTORE_FILE):
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)


def convert(src: str | Path, out: str | Path, dtype: str | None = "bfloat16") -> Path:
    """Convert `src` (HF target dir, z-lab DFlash drafter dir, or .gguf) into a bastion_jax checkpoint dir,
    stored in `dtype` (None: the source's own dtype; quantised GGUF tensors are dequantised to float32)."""
    from bastion_jax.checkpoints import save_drafter, save_target
    from bastion_jax.checkpoints.dflash import is_dflash_config, load_zlab_params

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConversionError(f"output path exists and is not a directory: {out}")
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"output directory is not empty: {out}")
    source = open_source(src)
    if is_dflash_config(source.hf_config):
        from bastion_jax.checkpoints.cond_head import has_head, read_head

        dcfg, dparams = load_zlab_params(Path(src), parse_dtype(dtype) or source.native_dtype())
        if has_head(src):  # a conditioned head beside it travels with it
            dparams = {**dparams, "cond_head": read_head(src, dcfg.hidden_size, dparams)[1]}
        out.mkdir(parents=True, exist_ok=True)
        save_drafter(out, dcfg, dparams, source=str(source.path))
        _copy_companions(Path(src), out)
        return out
    cfg, params = load_params(source, parse_dtype(dtype))
    out.mkdir(parents=True, exist_ok=True)
    save_target(out, cfg, params, source=str(source.path))
    source.save_tokenizer(out)
    return out
