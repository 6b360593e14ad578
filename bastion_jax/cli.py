"""Plumbing shared by the command-line tools: progress on stderr, bad input as one `error:` line (a
refused flag too: `Parser`), the --dtype and --lookup flags, JAX's persistent compilation cache."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

COMPILATION_CACHE_MAX_BYTES = 2 << 30  # older entries are evicted past this


def use_compilation_cache(directory: str | Path | None = None) -> Path | None:
    """Keep compiled executables on disk between runs (JAX's persistent compilation cache): a tool's
    warm-up compiles a dozen steps (~75 s for the default bastion run on 2 CPU cores), and a later run
    with the same shapes loads them instead (~23 s). A hit is the very executable a compile would give
    (keyed by the HLO, compile options, device and JAX version), so outputs never change.

    Called by the CLIs before anything compiles, not on import: a program that imports bastion_jax
    keeps its own JAX settings. $JAX_COMPILATION_CACHE_DIR, when set, wins (empty: no cache); else
    `directory`, else <cache root>/xla (see `default_model.cache_root`). Returns the directory used."""
    import jax

    if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # JAX reads it itself; the user chose
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"]) if os.environ["JAX_COMPILATION_CACHE_DIR"] else None
    if directory is None:
        from bastion_jax.default_model import cache_root

        directory = cache_root() / "xla"
    directory = Path(directory).expanduser()
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_MAX_BYTES)
    return directory


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose refusals are one `error: ...` line, as every other bad input is:
    argparse's own prints the whole usage block first (20 lines for `generate`) and hides the reason
    at the bottom. `--help` still prints the usage; subcommand parsers inherit the class."""

    def error(self, message: str):  # argparse's hook for a refused command line; never returns
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def positive_int(text: str) -> int:
    """argparse type for counts that must be >= 1: refused while parsing, before anything loads."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def count_arg(text: str) -> int:
    """argparse type for "up to N of these" counts where 0 means none: a negative N is refused while
    parsing (used as a slice bound it would quietly keep all but the last N)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return n


DEFAULT_BLOCK_SIZE = 16  # of a drafter built at random (--drafter random, profile --target, train)


def block_size_arg(text: str) -> int:
    """argparse type for --block-size (generate, profile, benchmarks): a block holds its anchor and at least
    one drafted slot, so a value below 2 is refused while parsing instead of quietly becoming the default."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 2:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 2 (the anchor and at least one drafted "
                                         f"token), got {text!r}")
    return n


def check_block_size(block_size: int | None, drafter: str | None) -> None:
    """--block-size sizes only a randomly built drafter: with any other (`drafter`: the resolved --drafter, a
    dir, "none" or None) it would be ignored, so it is refused (ValueError, one line) before anything loads."""
    if block_size is not None and drafter != "random":
        raise ValueError("--block-size only applies to --drafter random (a loaded drafter has its own block size)")


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


def resolve_dtype(name: str, *, default_pair: bool = False):
    """A --dtype value: "auto" is None (the loaders then keep the checkpoint's own dtype), except for
    the embedded default pair (`default_pair`) on a CPU with bf16 units: bfloat16. Why: there its
    greedy text is bf16 AR's bit for bit, and bastion ran 40% more tokens per second than in
    float32 on prompt kinds never tuned on (48.6 against 34.7 tok/s, 1.40x against 1.16x its AR;
    `benchmarks/results/cpu-smollm2-embed-table-2026-12-07.md`). A checkpoint the user names keeps
    its own dtype."""
    import jax
    import jax.numpy as jnp

    from bastion_jax.hardware import cpu_has_bf16_units

    if name != "auto":
        return jnp.dtype(name)
    if default_pair and jax.default_backend() == "cpu" and cpu_has_bf16_units():
        return jnp.dtype(jnp.bfloat16)
    return None


def dtype_note(flag: str, resolved=None) -> str:
    """Why a run computes in its dtype: `flag` as given, `resolved` what `resolve_dtype` made of it."""
    if flag != "auto":
        return "--dtype"
    if resolved is not None:
        return "the default pair on this CPU's bf16 units; --dtype float32 for the checkpoint's own"
    return "the checkpoint's dtype"


LOOKUP_HELP = ("context lookup in the tree modes: on (default) adds the continuation of the latest earlier "
               "occurrence of the text's last 1-4 tokens to every draft tree, as a chain beside the drafter's "
               "candidates, and lets bastion verify that chain alone when drafting does not pay; off: the "
               "drafter's candidates only (the official BASTION trees). Output is unchanged "
               "either way")


DATASTORE_HELP = ("with --lookup on, also offer chains copied from text the target wrote before, where they "
                  "promise more than the context's: auto (default) uses the drafter's datastore.npz when it ships one "
                  "(the default drafter does), off, or a file from `train_drafter datastore`. Output is unchanged")


def add_sampling_flags(parser, *, temperature_help: str = "", seed_help: str = "RNG seed for sampling (default 0)"
                       ) -> None:
    """--temperature, --top-k, --top-p (named as transformers and vLLM name them) and --seed, for
    `SamplingConfig(args.temperature, args.top_k, args.top_p)`; `temperature_help` is added to the
    temperature's help."""
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default); > 0 samples" + temperature_help)
    parser.add_argument("--top-k", dest="top_k", type=int, default=0,
                        help="sampling: keep only the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    parser.add_argument("--seed", type=int, default=0, help=seed_help)


def add_cond_head_flags(parser) -> None:
    """--cond-head on|off, --cond-depths and --cond-candidates: how a drafter's conditioned head
    (`cond_head.json`) drafts."""
    parser.add_argument("--cond-head", default="auto", choices=["auto", "on", "off"], help="use the drafter's "
                        "parent-conditioned head when one ships beside it (cond_head.json: each slot drafted given "
                        "the drafted token before it). auto (default) and on: use it; off drafts with the plain "
                        "DFlash drafter")
    parser.add_argument("--cond-depths", default="auto", type=_cond_depths_arg, help="tree depths 2..N take each parent's own law from "
                        "the head (auto: 4; 0: none, the spine's laws at every depth)")
    parser.add_argument("--cond-candidates", default="auto", type=_cond_candidates_arg, help="the head corrects "
                        "only each slot's N most likely columns under the head-free law (auto: 64 on CPU, where "
                        "the full correction costs more than it adds; every column elsewhere; 0 or a count at or above the "
                        "vocabulary: every column)")


def _auto_count(what: str):
    """An argparse type for a count the engine defaults when None: "auto" -> None, a whole number -> int,
    else refused while parsing (`what` names the count), so a bad value is refused before any model loads."""

    def parse(text: str) -> int | None:
        if text == "auto":
            return None
        if not text.isdigit():
            raise argparse.ArgumentTypeError(f"must be auto or a number of {what}, got {text!r}")
        return int(text)

    return parse


_depths_count = _auto_count("depths (0, 2, 3, ...)")


def _cond_depths_arg(text: str) -> int | None:
    """--cond-depths: auto, 0 (none) or N >= 2 (depths 2..N); 1 names no depth and is refused."""
    n = _depths_count(text)
    if n == 1:
        raise argparse.ArgumentTypeError("must be auto, 0 (no depth) or N >= 2 (depths 2..N take each parent's "
                                         "own law; depth 1 always takes the block's), got '1'")
    return n


_cond_candidates_arg = _auto_count("columns (0: all of them)")


def head_setting_words(engine) -> str:
    """How an engine drafts through its drafter's conditioned head, for reports ("" without one):
    the head, its per-parent depths and, when restricted, its candidates per slot."""
    config = engine.drafter.config if engine.drafter is not None else None
    if config is None or not config.cond_head_rank:
        return ""
    candidates = f", {engine.cond_candidates} candidates per slot" if engine.cond_candidates else ""
    return f"{config.head_words} (per-parent depths {engine.cond_depths}{candidates})"


def resolve_cond_head(flag: str) -> bool | None:
    """A --cond-head value for `load_drafter(cond_head=...)`: None (auto), True or False."""
    return None if flag == "auto" else flag == "on"


def check_cond_head(flag: str, drafter) -> None:
    """--cond-head on asks for the head: with no drafter, a random one or one that ships no
    `cond_head.json` it is refused (ValueError, one line), not quietly run without it."""
    if flag == "on" and (drafter is None or not drafter.config.cond_head_rank):
        what = ("there is no drafter" if drafter is None else "a random drafter has no conditioned head"
                if drafter.path is None else f"{drafter.path} ships no conditioned head (cond_head.json)")
        raise ValueError(f"--cond-head on: {what}; give a drafter that ships one, or --cond-head auto / off")


def add_lookup_flag(parser) -> None:
    parser.add_argument("--lookup", default="on", choices=["on", "off"], help=LOOKUP_HELP)
    parser.add_argument("--datastore", default="auto", help=DATASTORE_HELP)


def resolve_lookup(flag: str):
    """A --lookup value: the default `LookupConfig` or None (off)."""
    from bastion_jax.lookup import LookupConfig

    return LookupConfig() if flag == "on" else None
