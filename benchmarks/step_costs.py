"""Step costs against their yardsticks, and their independence from the cache size, in one run.

    python -m benchmarks.step_costs                                    # default pair, CPU checks of issue 14
    python -m benchmarks.step_costs --arch qwen3-8b --contexts 256,2048 --cache-lens 4096,16384
    python -m benchmarks.step_costs --arch smollm2-135m --layers 1 --buckets 1,4 --contexts 16 \
        --cache-lens 64,256 --reps 1 --out-dir /tmp/sc             # smoke run (tests)

For each cache length the profiler (`bastion_jax.profiler.run_profile`, the same engine and
executables as `generate`) times per bucket b and context c: verify(b), a plain b-token causal
forward, the draft and the host loop, and the AR step. Reported, with the issue's CPU targets:

  verify(b) / plain forward(b)      the tree mask, taps and walk on top of the target forward   <= 1.10
  draft / AR step                   the drafter block + tree build over a plain AR step         <= 0.35
  host / loop iteration             what the host adds per step, in the loop bastion runs at b
                                    (b = 1: root steps, dispatched ahead) and in fixed:b's       <= 3%
                                    (also the loop thread's own CPU time, measured directly)
  verify(b) at cache L / at cache l the same step with a larger cache (attention must follow
                                    the live context, not the cache)                            <= 1.15

Writes benchmarks/results/<name>.json and <name>.md with device, date and commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from bastion_jax.cli import fail, stderr_log
from benchmarks.report import commit, write_results

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {"verify_over_forward": 1.10, "draft_over_ar": 0.35, "host_frac": 0.03, "cache_ratio": 1.15}


def build_parser() -> argparse.ArgumentParser:
    from bastion_jax.profile import build_parser as profile_parser

    p = profile_parser()
    p.prog = "python -m benchmarks.step_costs"
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--cache-lens", default="1024,8192",
                   help="KV cache lengths to compare (default 1024,8192: 8x apart, within SmolLM2's 8192 positions)")
    p.set_defaults(out_dir=str(RESULTS), buckets="1,4,16,64", contexts="256", peaks="datasheet", no_plot=True)
    return p


def summarise(profiles: dict[int, object]) -> dict:
    """Per cache length the ratios of every cell, then the cache ratio of every (bucket, context)."""
    out: dict = {"per_cache": {}, "cache_ratio": {}}
    for cache_len, prof in profiles.items():
        out["per_cache"][str(cache_len)] = {
            "ar_step_s": {str(c): t for c, t in prof.ar_step_s.items()},
            "cells": [dict(dataclasses.asdict(p), verify_over_forward=p.verify_s / p.forward_s,
                           draft_over_ar=p.draft_s / prof.ar_step_s[p.context], host_frac=p.host_s / p.loop_s,
                           fixed_host_frac=p.fixed_host_s / p.fixed_loop_s, host_cpu_frac=p.host_cpu_s / p.loop_s,
                           call_cpu_frac=p.call_cpu_s / p.loop_s)
                      for p in prof.points],
            "compilations_during_timing": prof.compilations_during_timing,
        }
    small, big = min(profiles), max(profiles)
    if small != big:
        for p_small, p_big in zip(profiles[small].points, profiles[big].points):
            out["cache_ratio"][f"{p_small.bucket}@{p_small.context}"] = {
                "verify": p_big.verify_s / p_small.verify_s, "step": p_big.step_s / p_small.step_s}
        out["cache_ratio"]["ar"] = {str(c): profiles[big].ar_step_s[c] / t for c, t in profiles[small].ar_step_s.items()}
    return out


def markdown(meta: dict, summary: dict) -> str:
    lines = [f"# {meta['name']}", "", f"{meta['device']}, {meta['date']}, commit {meta['commit']}, {meta['dtype']}, "
             f"target {meta['model']}, batch 1, median of {meta['reps']}; targets in brackets.", ""]
    for cache_len, r in summary["per_cache"].items():
        lines += [f"## cache {cache_len} slots", "",
                  "| bucket | context | verify ms | plain forward ms | verify / forward [<= 1.10] | draft ms | "
                  "AR ms | draft / AR [<= 0.35] | host % bastion [<= 3] | host CPU % bastion | of which step call % | "
                  "host % fixed:b [<= 3] |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in r["cells"]:
            ar = r["ar_step_s"][str(c["context"])]
            lines.append(f"| {c['bucket']} | {c['context']} | {c['verify_s'] * 1e3:.2f} | {c['forward_s'] * 1e3:.2f} | "
                         f"{c['verify_over_forward']:.2f} | {c['draft_s'] * 1e3:.2f} | {ar * 1e3:.2f} | "
                         f"{c['draft_over_ar']:.2f} | {100 * c['host_frac']:.1f} | {100 * c['host_cpu_frac']:.1f} | "
                         f"{100 * c['call_cpu_frac']:.1f} | {100 * c['fixed_host_frac']:.1f} |")
        lines += ["", f"Compilations during timing: {r['compilations_during_timing']}.", "",
                  "host %: (loop iteration - device time) / loop iteration, a difference of two timings (noise "
                  "about +-2%). host CPU %: the loop thread's own CPU time / loop iteration, measured directly; "
                  "where bastion's next step waits for the read (b > 1) the device is idle for exactly that time, "
                  "at b = 1 its root steps go out ahead and the time overlaps the device's. of which step call %: "
                  "the part of that CPU time inside the compiled step's call (its arguments and XLA's per-execution "
                  "work on the calling thread, which grows with the step's kernel count); the rest is the loop's "
                  "Python and read.", ""]
    if summary["cache_ratio"]:
        caches = list(summary["per_cache"])
        lines += [f"## cache {max(map(int, caches))} slots over cache {min(map(int, caches))} slots [<= 1.15]", "",
                  "| bucket@context | verify | full step |", "|---|---|---|"]
        for k, v in summary["cache_ratio"].items():
            if k != "ar":
                lines.append(f"| {k} | {v['verify']:.3f} | {v['step']:.3f} |")
        lines += ["", "AR step: " + ", ".join(f"context {c}: {v:.3f}" for c, v in summary["cache_ratio"]["ar"].items()),
                  ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = stderr_log(args.quiet)
    if args.arch is None and args.target is None:
        from bastion_jax import default_drafter_dir, default_target_dir

        args.target = str(default_target_dir(verbose=not args.quiet))
        args.drafter = args.drafter or str(default_drafter_dir())

    from bastion_jax.checkpoints import CheckpointError
    from bastion_jax.config import ConfigError
    from bastion_jax.engine import GenerationError
    from bastion_jax.profile import ProfileError, setup
    from bastion_jax.profile_report import device_meta
    from bastion_jax.profiler import run_profile

    try:
        cache_lens = sorted(int(x) for x in args.cache_lens.split(","))
        args.max_len = cache_lens[-1]
        s = setup(args, log)  # validates contexts and buckets against the largest cache
        profiles = {}
        for cache_len in cache_lens:
            log(f"cache {cache_len} slots")
            profiles[cache_len] = run_profile(s.engine, s.contexts, cache_len, reps=args.reps, warmup=args.warmup,
                                              progress=not args.quiet)
        meta = dict(device_meta(s.engine, s.label, s.model_name, args.reps, args.warmup), commit=commit())
    except (ProfileError, CheckpointError, ConfigError, GenerationError, ValueError) as e:
        return fail(e)
    name = args.name or f"{meta['backend']}-{s.label}-step-costs"
    meta["name"] = name
    summary = summarise(profiles)
    write_results(args.out_dir, name, {"meta": meta, "targets": TARGETS, **summary}, markdown(meta, summary),
                  args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
