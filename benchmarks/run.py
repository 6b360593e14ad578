"""Benchmark harness: ar, dflash, a fixed:N sweep and bastion over prompt sets, in one run.

    python -m benchmarks.run --prompts ../shared/data/gsm8k_test.jsonl.gz --max-prompts 10 \
        --drafter DIR --name smollm2-gsm8k

Per prompt (or batch of prompts, `--batch`), per set and overall: tau (mean accepted + 1 per step),
tokens/s, the ratio to AR measured in this run (overall also of decoding alone, with the mean time to
first token), the best fixed budget in hindsight, the bucket histogram, and whether the tokens equal
AR's (they must at T=0; at T > 0, `--temperature`, each mode draws its own samples and the answers are
not compared: every mode samples the target's law exactly, so the figures are the speed of the same
sampling). Writes benchmarks/results/<name>.json, .md, .csv and .png, stamped with device, date and
commit. Prompt files are read in place, never copied.
Runs on CPU with tiny models (slowly) and on GPU for real numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from bastion_jax.cli import (DEFAULT_BLOCK_SIZE, Parser, add_cond_head_flags, add_lookup_flag, add_sampling_flags,
                             block_size_arg, check_block_size, check_cond_head, fail, head_setting_words, positive_int,
                             resolve_cond_head, use_compilation_cache)
from bastion_jax.acceptance import STANDARD_SETS, PromptError, read_prompts, resolve_prompt_file
from benchmarks.report import commit, markdown_table, per_set, plot, write_csv

RESULTS = Path(__file__).resolve().parent / "results"


def median_run(results: list):
    """The run of median wall time (engine time after compilation) among repeats of one mode on one prompt."""
    ordered = sorted(results, key=lambda r: r.stats.ttft_s + r.stats.decode_s)
    return ordered[(len(ordered) - 1) // 2]


def sampling_words(sampling) -> str:
    """How a run sampled, for its report's header."""
    if sampling.greedy:
        return "T=0"
    words = f"T={sampling.temperature:g}"
    if sampling.top_k:
        words += f", top-k {sampling.top_k}"
    if sampling.top_p < 1.0:
        words += f", top-p {sampling.top_p:g}"
    return words + " (answers not compared: each run draws its own samples)"


def decode_rate(totals: dict, rows: int) -> float:
    """Tokens/s of decoding alone: every token after each of the `rows` prompts' first (which the
    prefill gives), over the engine's time after the prefill. On long prompts the prefill, the same
    work in every mode, is a large part of the wall time and dilutes the ratio of tokens/s (a
    770-token summarisation prompt: ~40% of a 96-token answer's time on the 2-core CPU), so both
    figures are reported."""
    return (totals["tokens"] - rows) / totals["decode"] if totals["decode"] > 0 else 0.0


def identity_cell(identical: bool | None) -> str:
    return "n/a" if identical is None else "yes" if identical else "NO"


def build_parser() -> Parser:
    p = Parser(prog="python -m benchmarks.run", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", nargs="+", default=list(STANDARD_SETS),
                   help="standard sets by name (" + ", ".join(STANDARD_SETS) + "; read from ../shared/data beside "
                   "the checkout) and/or JSONL(.gz) files with a prompt field (default: every standard set)")
    p.add_argument("--max-prompts", type=positive_int, default=5, help="prompts per set (default 5)")
    p.add_argument("--target", help="target checkpoint (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="drafter dir, or 'random' (default: the shipped drafter with the default "
                   "target, else random)")
    p.add_argument("--modes", help="comma-separated policies to run (default: ar, dflash, the fixed sweep, bastion, "
                   "and bastion-paper when the largest bucket is >= 32); "
                   "ar always runs: it is the reference for identity and ratios")
    p.add_argument("--block-size", type=block_size_arg, help="block size of a --drafter random (>= 2, default 16)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--reps", type=int, default=1, help="rounds of every mode per prompt (rotated order); each "
                   "mode keeps its median-time run: a 2-core CPU drifts 10-20%% within a minute, so single "
                   "runs make noisy ratios (default 1)")
    p.add_argument("--batch", type=int, default=1, help="prompts per request (consecutive prompts of the list, "
                   "whose number must be a multiple of it): the tokens/s of a batch, which ends with its last row; "
                   "bastion is calibrated at this size (default 1)")
    p.add_argument("--buckets", help="tree sizes compiled (default: the engine's, 1,4,8,16,32,64 or on CPU 1,4,8,16: "
                   "the largest prices every draft, so neither the fixed sweep nor --modes fixed:N adds one)")
    p.add_argument("--fixed", help="fixed:N sweep sizes of the default modes, which must be buckets (default: those "
                   "of 4,16,64 that are); with --modes, name fixed:N there")
    p.add_argument("--draft-vocab", default="auto", help="drafter LM head over the N most frequent tokens: auto, "
                   "full or N (see python -m bastion_jax.generate --help)")
    add_lookup_flag(p)
    add_cond_head_flags(p)
    p.add_argument("--tree-top-k", type=int, default=128, help="tree width: drafter candidates per position "
                   "(default 128)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: the checkpoint's own dtype (the default pair on a CPU with bf16 units: "
                   "bfloat16, as `generate`)")
    add_sampling_flags(p, temperature_help=", and the modes' answers are not compared with AR's",
                       seed_help="RNG seed of the first request's runs (request i: seed + i; a mode's repeats "
                       "draw the same samples)")
    p.add_argument("--name", default="bench", help="results file name (benchmarks/results/<name>.json)")
    p.add_argument("--no-calibrate", action="store_true")
    p.add_argument("--out-dir", default=str(RESULTS), help="where to write <name>.json/.md (default benchmarks/results)")
    return p


def plan_modes(args, buckets: tuple[int, ...]) -> list[str]:
    """The modes to run, "ar" first, every one parsed and its tree sizes checked against `buckets`, so a
    typo or a size that is no bucket is refused before minutes of loading and calibration, not at
    warm-up. Raises PolicyError (a ValueError) naming the flag and what to change."""
    from bastion_jax.controller import Policy, PolicyError, check_buckets, parse_buckets

    if args.modes is not None:
        if args.fixed:
            raise PolicyError(f"--fixed {args.fixed} sizes the default modes' sweep; with --modes, name its sizes "
                              "there (fixed:N)")
        policies = list(dict.fromkeys(Policy.parse(m.strip()) for m in args.modes.split(",") if m.strip()))
    else:
        sweep = parse_buckets(args.fixed) if args.fixed else tuple(n for n in (4, 16, 64) if n in buckets)
        policies = [Policy.parse(m) for m in ["dflash", *(f"fixed:{n}" for n in sweep), "bastion"]
                    + (["bastion-paper"] if max(buckets) >= 32 else [])]
    check_buckets(policies, buckets, "--modes" if args.modes is not None else "--fixed")
    return ["ar"] + [str(q) for q in policies if q.kind != "ar"]


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    if args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    if args.tree_top_k < 1:
        p.error(f"--tree-top-k must be >= 1, got {args.tree_top_k}")
    from bastion_jax.controller import default_buckets, parse_buckets
    from bastion_jax.sampling import SamplingConfig

    try:  # every flag is checked before anything loads
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
        buckets = parse_buckets(args.buckets) if args.buckets else default_buckets()
        modes = plan_modes(args, buckets)
        if args.drafter is None:
            from bastion_jax.default_model import default_drafter_dir

            shipped = default_drafter_dir() if args.target is None else None
            args.drafter = str(shipped) if shipped else "random"
        check_block_size(args.block_size, args.drafter)
    except ValueError as e:
        p.error(str(e))
    try:
        args.prompts = [str(resolve_prompt_file(f)) for f in args.prompts]
        prompts = [(Path(f).name.split(".")[0], t) for f in args.prompts for t in read_prompts(f, args.max_prompts)]
    except PromptError as e:
        raise SystemExit(f"error: {e}") from None
    if len(prompts) % args.batch:
        raise SystemExit(f"error: --batch {args.batch} needs a multiple of {args.batch} prompts, got {len(prompts)} "
                         "(change --max-prompts or --prompts)")
    use_compilation_cache()
    try:  # a checkpoint, the engine or a run that refuses its input: one line, no traceback
        return measure(args, prompts, buckets, modes, sampling)
    except ValueError as e:  # CheckpointError, ConfigError, DefaultModelError, GenerationError, PolicyError, ...
        return fail(e)


def measure(args, prompts: list[tuple[str, str]], buckets: tuple[int, ...], modes: list[str], sampling) -> int:
    """Load the models, calibrate, warm every mode up, time them on every prompt and write the results."""
    import jax

    from bastion_jax.checkpoints import load_drafter, load_target, random_drafter
    from bastion_jax.default_model import default_target_dir
    from bastion_jax.engine import Engine
    from bastion_jax.cli import resolve_dtype, resolve_lookup
    from bastion_jax.presets import tiny_drafter_config
    from bastion_jax.text import encode_prompt, load_tokenizer

    target_path = args.target or default_target_dir()
    target = load_target(target_path, resolve_dtype(args.dtype, default_pair=args.target is None))
    tok = load_tokenizer(target)
    if args.drafter == "random":
        block = DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size
        drafter = random_drafter(tiny_drafter_config(target.config, block_size=block), target.dtype)
    else:
        drafter = load_drafter(args.drafter, target.config, target.dtype,
                               cond_head=resolve_cond_head(args.cond_head))
    check_cond_head(args.cond_head, drafter)
    engine = Engine(target, tok, drafter=drafter, buckets=buckets, top_k=args.tree_top_k,
                    draft_vocab=args.draft_vocab,
                    lookup=resolve_lookup(args.lookup), datastore=args.datastore,
                    cond_depths=args.cond_depths, cond_candidates=args.cond_candidates)
    ids = [encode_prompt(tok, t) for _, t in prompts]
    longest = max(map(len, ids))
    # One cache length for every mode (the largest slack, the tree's), so all pay the same attention cost.
    cache_len = engine.cache_len_for([longest], args.max_new_tokens, None, engine.slack("bastion"))
    prices = None
    if not args.no_calibrate:
        engine.calibrate(cache_len, sampling, batch=args.batch)
        # The fit each run measured (ms per step at context 256): runs differ by what their calibration
        # read as much as by anything else (the gate held 623 of ~830 chat steps after one, 263-303
        # after others), so the prices travel with the numbers.
        prices = {str(v): round(engine.latency.predict(v, 256) * 1e3, 2) for v in engine.latency.alpha}
    device = jax.devices()[0].device_kind
    # Warm-up, untimed: every mode compiles and runs once at the measured shapes, so no mode's first
    # timed prompt pays for compilation or first-run allocations.
    for mode in modes:
        engine.generate(ids[: args.batch], max_new_tokens=min(8, args.max_new_tokens), mode=mode, max_len=cache_len,
                        sampling=sampling, seed=args.seed)
    rows, totals = [], {m: {"tokens": 0, "seconds": 0.0, "committed": 0, "steps": 0, "buckets": {}, "ttft": 0.0,
                            "decode": 0.0} for m in modes}
    for i, first in enumerate(range(0, len(prompts), args.batch)):
        group = range(first, first + args.batch)
        batch = [ids[j] for j in group]
        source = "+".join(dict.fromkeys(prompts[j][0] for j in group))
        text = prompts[first][1][:80] + (f" (+{args.batch - 1} more)" if args.batch > 1 else "")
        # Modes run in a rotated order per prompt (prompt i starts with mode i mod M), so no mode is
        # always the first or the last one after another mode's run; rows are reported in mode order.
        order = modes[i % len(modes):] + modes[: i % len(modes)]
        runs: dict[str, list] = {m: [] for m in modes}
        for _ in range(args.reps):
            for m in order:
                runs[m].append(engine.generate(batch, max_new_tokens=args.max_new_tokens, mode=m, max_len=cache_len,
                                               sampling=sampling, seed=args.seed + i))
        for m, rs in runs.items():
            if sampling.greedy and any(r.tokens != rs[0].tokens for r in rs):
                raise SystemExit(f"error: {m} gave different tokens on repeated runs of one prompt at T=0")
        results = {m: median_run(rs) for m, rs in runs.items()}
        ar_tokens, ar_tps = results["ar"].tokens, results["ar"].stats.tokens_per_s
        for mode in modes:
            res = results[mode]
            s = res.stats
            row = {"source": source, "prompt": text, "mode": mode, "new_tokens": s.new_tokens,
                   "tau": s.tau, "tokens_per_s": s.tokens_per_s, "ratio_to_ar": s.tokens_per_s / ar_tps,
                   "identical_to_ar": res.tokens == ar_tokens if sampling.greedy else None, "buckets": s.buckets,
                   "compilations_after_warmup": s.compilations_after_warmup, "steps": s.row_steps,
                   "seconds": s.ttft_s + s.decode_s, "ttft_s": s.ttft_s, "decode_s": s.decode_s}
            rows.append(row)
            t = totals[mode]
            t["tokens"] += s.new_tokens
            t["seconds"] += s.ttft_s + s.decode_s
            t["ttft"] += s.ttft_s
            t["decode"] += s.decode_s
            t["committed"] += s.committed
            t["steps"] += s.row_steps
            for b, n in s.buckets.items():
                t["buckets"][b] = t["buckets"].get(b, 0) + n
            print(f"{source:>12} {mode:>9} tau {s.tau:5.2f} {s.tokens_per_s:8.1f} tok/s "
                  f"x{row['ratio_to_ar']:.2f}" + (f" identical={row['identical_to_ar']}" if sampling.greedy else ""),
                  file=sys.stderr)
    by_source: dict[str, dict[str, float]] = {}
    for src in dict.fromkeys(r["source"] for r in rows):
        by_source[src] = {}
        for m in modes:
            mine = [r for r in rows if r["source"] == src and r["mode"] == m]
            by_source[src][m] = sum(r["tau"] * r["steps"] for r in mine) / max(1, sum(r["steps"] for r in mine))
    ar_rate = totals["ar"]["tokens"] / totals["ar"]["seconds"]
    requests = len(prompts) // args.batch
    decode = {m: decode_rate(t, len(prompts)) for m, t in totals.items()}
    overall = {m: {"tau": t["committed"] / t["steps"] if t["steps"] else 0.0,
                   "tokens_per_s": t["tokens"] / t["seconds"],
                   "ratio_to_ar": t["tokens"] / t["seconds"] / ar_rate, "buckets": t["buckets"],
                   "ttft_ms": 1e3 * t["ttft"] / requests, "decode_tokens_per_s": decode[m],
                   "decode_ratio_to_ar": decode[m] / decode["ar"] if decode["ar"] > 0 else 0.0,
                   "all_identical_to_ar": (all(r["identical_to_ar"] for r in rows if r["mode"] == m)
                                           if sampling.greedy else None)}
               for m, t in totals.items()}
    meta = {"device": device, "date": datetime.date.today().isoformat(), "target": str(target_path),
            "drafter": args.drafter, "dtype": target.dtype.name, "max_new_tokens": args.max_new_tokens,
            "buckets": list(buckets), "prompt_files": [Path(f).name for f in args.prompts],
            "prompts": len(prompts), "batch": args.batch, "lookup": args.lookup,
            "sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                         "seed": args.seed},
            "reps": args.reps, "commit": commit(),
            "cond_head_rank": drafter.config.cond_head_rank if drafter is not None else 0,
            "cond_head_recurrent": drafter is not None and drafter.config.cond_head_recurrent,
            "cond_depths": engine.cond_depths,
            "cond_candidates": engine.cond_candidates,
            "calibrated_step_ms_at_256": prices}
    training = Path(args.drafter) / "training.json"
    if training.is_file():  # how the drafter was trained travels with its numbers
        meta["drafter_training"] = json.loads(training.read_text())
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.json").write_text(json.dumps({"meta": meta, "overall": overall, "tau_by_source": by_source,
                                                                "rows": rows}, indent=2))
    lines = [f"# {args.name}", "", f"{meta['device']}, {meta['date']}, {meta['dtype']}, drafter {args.drafter}, "
             f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, {sampling_words(sampling)}, "
             f"context lookup {args.lookup}"
             + (f", {head_setting_words(engine)}"
                if meta["cond_head_rank"] else (", conditioned head off" if args.cond_head == "off" else ""))
             + (f", batches of {args.batch} prompts" if args.batch > 1 else "")
             + (f", median-time run of {args.reps} per mode and prompt" if args.reps > 1 else ""), "",
             "| mode | tau | tokens/s | ratio to AR | identical to AR | buckets | TTFT ms (mean) | decode tokens/s | "
             "decode ratio to AR |", "|---" * 9 + "|"]
    for m, o in overall.items():
        hist = " ".join(f"{b}:{n}" for b, n in sorted(o["buckets"].items()))
        lines.append(f"| {m} | {o['tau']:.2f} | {o['tokens_per_s']:.1f} | {o['ratio_to_ar']:.2f} | "
                     f"{identity_cell(o['all_identical_to_ar'])} | {hist} | {o['ttft_ms']:.0f} | "
                     f"{o['decode_tokens_per_s']:.1f} | {o['decode_ratio_to_ar']:.2f} |")
    lines += ["", "tau by prompt set:", "", "| set | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for src, taus in by_source.items():
        lines.append(f"| {src} | " + " | ".join(f"{taus[m]:.2f}" for m in modes) + " |")
    sets = per_set(rows, modes)
    lines += [""] + markdown_table(sets, modes)
    write_csv(out_dir / f"{args.name}.csv", sets, modes)
    (out_dir / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(out_dir / f"{args.name}.png", sets, modes, f"{args.name}: {meta['device']}, {meta['date']}, {meta['commit']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
