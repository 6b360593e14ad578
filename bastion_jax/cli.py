"""Plumbing shared by the command-line tools: progress on stderr, bad input as one `error:` line,
the --dtype and --lookup flags."""

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


LOOKUP_HELP = ("context lookup in the tree modes: on (default) adds the continuation of the latest earlier "
               "occurrence of the text's last 1-4 tokens to every draft tree, as a chain beside the drafter's "
               "candidates, and lets bastion verify that chain alone when drafting does not pay; off: the "
               "drafter's candidates only (the official BASTION trees). Output is unchanged "
               "either way")


def add_lookup_flag(parser) -> None:
    parser.add_argument("--lookup", default="on", choices=["on", "off"], help=LOOKUP_HELP)


def resolve_lookup(flag: str):
    """A --lookup value: the default `LookupConfig` or None (off)."""
    from bastion_jax.lookup import LookupConfig

    return LookupConfig() if flag == "on" else None
