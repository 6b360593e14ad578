"""A checkpoint opened for reading: its HF-style config and lazily loaded, HF-named tensors.

Tensors are loaded one at a time by name so that converting an 8B model never holds a full fp32
copy on the host: each tensor is cast to the target dtype as soon as it is read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import numpy as np


# The float dtypes a checkpoint may be kept in when no dtype is asked for.
NATIVE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass
class Source:
    path: Path
    hf_config: dict[str, Any]
    names: list[str]  # HF parameter names, e.g. "model.layers.0.self_attn.q_proj.weight"
    load: Callable[[str], np.ndarray]
    save_tokenizer: Callable[[Path], None]
    # The checkpoint's own dtype name as found (HF config / safetensors headers; GGUF tensor types,
    # "float32" when any tensor is quantised, since those are dequantised to float32).
    dtype: str | None = None

    def native_dtype(self):
        """The dtype loading keeps when none is asked for (a jnp dtype); an error if it is not a float
        dtype the model computes in."""
        import jax.numpy as jnp

        from bastion_jax.checkpoints.errors import ConversionError

        if self.dtype not in NATIVE_DTYPES:
            raise ConversionError(f"{self.path} stores {self.dtype or 'an unknown dtype'}, which the model does not "
                                  f"compute in; choose one with --dtype ({', '.join(NATIVE_DTYPES[:2])})")
        return jnp.dtype(self.dtype)


def open_source(path: str | Path) -> Source:
    """Open an HF safetensors directory or a GGUF file."""
    from bastion_jax.checkpoints.errors import ConversionError

    path = Path(path)
    if not path.exists():
        raise ConversionError(f"checkpoint not found: {path}")
    if path.is_file() and path.suffix == ".gguf":
        from bastion_jax.checkpoints.gguf_file import open_gguf

        return open_gguf(path)
    if path.is_dir():
        from bastion_jax.checkpoints.hf import open_hf

        return open_hf(path)
    raise ConversionError(f"not a checkpoint (expected an HF directory or a .gguf file): {path}")
