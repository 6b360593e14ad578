"""`python -m bastion_jax.train_drafter eval`: the acceptance report's command line.

The report itself (decoding each prompt set with every mode, tau, AR identity, the tables and files)
is `bastion_jax.acceptance`; this module only reads the flags, builds the engine they describe and
records the setting beside the figures, so a report can always be rerun from its own JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from bastion_jax.cli import (add_cond_head_flags, add_lookup_flag, check_cond_head, head_setting_words, resolve_cond_head,
                             resolve_lookup)


def add_eval_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """The `eval` subcommand's flags (`common`: the target flags every subcommand shares)."""
    e = sub.add_parser("eval", parents=[common], help="acceptance report: tau per mode and prompt set, AR "
                       "identity checked (T=0)")
    e.add_argument("--drafter", help="drafter dir (default: the shipped drafter of the default target)")
    e.add_argument("--prompts", nargs="+", default=["gsm8k_test", "humaneval", "mt_bench"],
                   help="standard sets by name (mt_bench, gsm8k_test, math500, humaneval, mbpp, spec_bench: read "
                   "from ../shared/data beside the checkout) and/or JSONL(.gz) prompt files (default: gsm8k_test "
                   "humaneval mt_bench: math, code, chat)")
    e.add_argument("--max-prompts", type=int, default=8, help="prompts per set (default 8)")
    e.add_argument("--max-new-tokens", type=int, default=96)
    e.add_argument("--modes", default="dflash,fixed:32,bastion", type=_modes_arg, help="comma-separated policies "
                   "besides ar (default dflash,fixed:32,bastion)")
    e.add_argument("--buckets", type=_buckets_arg, help="tree sizes compiled (default: the engine's, 1,4,8,16,32,64 "
                   "or on CPU 1,4,8,16, plus the N of each fixed:N in --modes; given, every fixed:N must be one)")
    add_lookup_flag(e)
    e.add_argument("--tree-top-k", type=int, default=128)
    e.add_argument("--draft-vocab", default="auto", help="as generate --draft-vocab (auto, full or N)")
    add_cond_head_flags(e)
    e.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (default 8)")
    e.add_argument("--no-chat", action="store_true", help="prompts as plain text (no chat template)")
    e.add_argument("--out", help="also write the report to OUT.json and OUT.md")


def _modes_arg(text: str) -> list[str]:
    """argparse type for --modes: each policy parsed (`Policy.parse`) and named canonically, "ar" and
    repeats dropped, so a typo is refused while parsing, before the target loads."""
    from bastion_jax.controller import Policy, PolicyError

    try:
        policies = [Policy.parse(m.strip()) for m in text.split(",") if m.strip()]
    except PolicyError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    modes = [str(q) for q in dict.fromkeys(policies) if q.kind != "ar"]
    if not modes:
        raise argparse.ArgumentTypeError(f"{text!r} names no policy besides ar (which always runs: the reference)")
    return modes


def _buckets_arg(text: str) -> tuple[int, ...]:
    """argparse type for --buckets (`parse_buckets`): refused while parsing, before the target loads."""
    from bastion_jax.controller import PolicyError, parse_buckets

    try:
        return parse_buckets(text)
    except PolicyError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def eval_buckets(modes: Sequence[str], buckets: tuple[int, ...] | None) -> tuple[int, ...]:
    """The tree sizes eval compiles: --buckets as given (`buckets`), each fixed:N of `modes` checked
    against them; else the engine's default (`controller.default_buckets`, as generate and
    benchmarks.run) plus those N, so `--modes fixed:32` runs on CPU too. Checked before the drafter
    loads or bastion calibrates; raises PolicyError naming what to add."""
    from bastion_jax.controller import Policy, check_buckets, default_buckets

    policies = [Policy.parse(m) for m in modes]
    if buckets is None:
        buckets = tuple(sorted(set(default_buckets()) | {q.size for q in policies if q.kind == "fixed"}))
    check_buckets(policies, buckets)
    return buckets


def buckets_words(buckets: tuple[int, ...], given: bool) -> str:
    """The compiled tree sizes in words, for the report's header: which ones bastion and the fixed
    modes could verify, and whether --buckets chose them or the device's default (and fixed:N) did."""
    from bastion_jax.controller import default_buckets

    added = sorted(set(buckets) - set(default_buckets()))
    how = "--buckets" if given else "this device's default" + "".join(
        f"{' plus' if i == 0 else ','} {n} for fixed:{n}" for i, n in enumerate(added))
    return f"buckets {','.join(map(str, buckets))} compiled ({how})"


def run_eval(args, target, log) -> None:
    """The acceptance report (bastion_jax.acceptance) of a drafter on prompt sets."""
    import datetime

    import jax
    import numpy as np

    from bastion_jax.acceptance import (acceptance, markdown, read_prompts, resolve_prompt_file, set_name,
                                        write_report)
    from bastion_jax.checkpoints import load_drafter
    from bastion_jax.default_model import default_drafter_dir
    from bastion_jax.engine import Engine
    from bastion_jax.text import encode_prompt, load_tokenizer

    drafter_dir = args.drafter or (default_drafter_dir() if args.target is None else None)
    if drafter_dir is None:
        raise ValueError("eval needs --drafter (no drafter ships for this target)")
    if args.max_prompts < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        raise ValueError("--max-prompts, --batch-size and --max-new-tokens must be >= 1")
    modes = args.modes  # parsed by `_modes_arg`
    buckets = eval_buckets(modes, args.buckets)
    texts = {set_name(path): read_prompts(path, args.max_prompts) for path in map(resolve_prompt_file, args.prompts)}
    drafter = load_drafter(drafter_dir, target.config, target.dtype, cond_head=resolve_cond_head(args.cond_head))
    check_cond_head(args.cond_head, drafter)
    tok = load_tokenizer(target)
    engine = Engine(target, tok, drafter=drafter, buckets=buckets, top_k=args.tree_top_k,
                    draft_vocab=args.draft_vocab,
                    lookup=resolve_lookup(args.lookup), datastore=args.datastore,
                    cond_depths=args.cond_depths, cond_candidates=args.cond_candidates)
    sets = {name: [encode_prompt(tok, t, chat=not args.no_chat) for t in ts] for name, ts in texts.items()}
    if "bastion" in modes:  # its tree sizes follow the latency model: profile this machine first
        longest = max(len(p) for ps in sets.values() for p in ps)
        cache_len = engine.cache_len_for([longest], args.max_new_tokens, None, engine.slack("bastion"))
        engine.calibrate(cache_len, batch=min(args.batch_size, max(len(p) for p in sets.values())))
    log(f"eval: {drafter_dir} on {', '.join(f'{n} ({len(p)})' for n, p in sets.items())}, modes "
        f"{', '.join(modes)}, {args.max_new_tokens} new tokens, batches of {args.batch_size}, T=0, buckets "
        f"{','.join(map(str, buckets))}")
    # Where drafted runs stop on tokens the drafter's vocabulary leaves out (trees cannot draft them; its
    # training scored no loss on them, so chains over the full vocabulary rarely do either).
    rare_top = int(engine.draft_vocab.ids.shape[0]) if engine.draft_vocab is not None else None
    rare = None
    if rare_top is not None:
        rare = np.ones(target.config.vocab_size, bool)
        rare[np.asarray(engine.draft_vocab.ids)] = False
    report = acceptance(engine, sets, modes, args.max_new_tokens, args.batch_size, rare=rare,
                        progress=None if args.quiet else lambda n, m, st: log(f"  {n} {m}: tau {st.tau:.2f}"))
    lines = markdown(report, modes, rare_top)
    print("\n".join(lines))
    if args.out:
        meta = {"drafter": str(drafter_dir), "target": str(target.path), "dtype": target.dtype.name,
                "device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(),
                "max_new_tokens": args.max_new_tokens, "buckets": list(buckets), "tree_top_k": args.tree_top_k,
                "draft_vocab": args.draft_vocab, "lookup": args.lookup, "datastore": args.datastore,
                "batch_size": args.batch_size, "cond_head_rank": drafter.config.cond_head_rank,
                "cond_head_recurrent": drafter.config.cond_head_recurrent, "cond_depths": engine.cond_depths,
                "cond_candidates": engine.cond_candidates,
                "prompts": {n: len(p) for n, p in sets.items()}}
        training = Path(drafter_dir) / "training.json"
        if training.is_file():
            meta["drafter_training"] = json.loads(training.read_text())
        setting = (f"first {args.max_prompts} prompts per set, batches of {args.batch_size}, "
                   f"{buckets_words(buckets, args.buckets is not None)}, context lookup "
                   f"{args.lookup}{f' (datastore {args.datastore})' if args.lookup == 'on' else ''} (tree modes)"
                   + (f", {head_setting_words(engine)}" if meta["cond_head_rank"] else ""))
        for path in write_report(args.out, report, lines, meta, setting):
            log(f"wrote {path}")
