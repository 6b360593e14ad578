"""Plumbing shared by the command-line tools: progress on stderr, bad input as one `error:` line,
the --dtype flag."""

from __future__ import annotations

import sys
from typing import Callable


def stderr_log(quiet: bool) -> Callable[[str], None]:
    """Progress and summaries go to stderr (stdout stays for results), silenced by --quiet."""
    def log(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    return log


def fail(e: BaseException) -> int:
    """Report `e` as a single `error: ...` line (never a traceback); returns the exit status 2."""
    print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
    return 2


def resolve_dtype(name: str):
    """A --dtype value: "auto" is None (the loaders then keep the checkpoint's own dtype)."""
    import jax.numpy as jnp

    return None if name == "auto" else jnp.dtype(name)


def dtype_note(flag: str) -> str:
    return "the checkpoint's dtype" if flag == "auto" else "--dtype"
