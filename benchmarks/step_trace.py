"""Where a step's device time goes: a `jax.profiler` trace of a few AR and verify(b) steps, per XLA op.

    python -m benchmarks.perf_8b --buckets 1,64 --contexts 2048 --trace DIR     # take one (also verify_probe)
    python -m benchmarks.step_trace DIR [--top 25]        # summarise a trace taken earlier, on any machine

Why: on an H200 the AR step at Qwen3-8B shapes ran at 0.57 of its HBM floor and verify(64) at 1.25-1.30
AR steps (issue 14's goals: 0.85 and 1.10), and a timing says how long, not where. A trace of the
compiled steps names every kernel with its XLA op (`hlo_op`) and program (`hlo_module`), so one lease's
trace, summarised on the CPU afterwards, shows which ops hold the time: the products, the prefix
attention, the tree part, copies, or the gaps between kernels (device busy time against wall time).

`take` runs `steps` AR steps and `steps` verify(b) steps at one context under the profiler (the
executables already compiled by the caller's measurements); `bastion_jax.trace_report` summarises the
trace per program and op (also what `train_drafter train --trace` writes).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

from bastion_jax.trace_report import markdown, summarise, write


def take(engine, cache_len: int, context: int, bucket: int, steps: int, log_dir: str | Path, log=print) -> dict:
    """Trace `steps` AR steps and `steps` verify(bucket) steps (batch 1, one context) under
    `jax.profiler.trace(log_dir)`, after one untraced call of each (their executables come from the
    engine's table: compiled already when the caller measured them). Writes step-trace.md / .json
    beside the trace and returns the summary."""
    import jax

    from benchmarks.verify_probe import TargetSteps

    exe = engine.executables
    ar_step = exe.decode(1, cache_len)
    verify = exe.verify_steps(1, cache_len, (bucket,))[bucket]
    exe.ready()
    calls, length = TargetSteps(engine, cache_len, ar_step, {bucket: verify}), TargetSteps.lengths(context)

    def ar():
        return calls.ar(length)

    def ver():
        return calls.verify(bucket, length)

    jax.block_until_ready(ar())
    jax.block_until_ready(ver())
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.glob("*.hlo.txt.gz"):  # an earlier trace's programs (another bucket) would name these ops
        old.unlink()
    for name, fn in (("decode", ar_step), (f"tree_verify{bucket}", verify)):  # what each traced op is (shapes, source)
        text = fn.as_text() if hasattr(fn, "as_text") else None
        if text:
            with gzip.open(log_dir / f"{name}.hlo.txt.gz", "wt") as f:
                f.write(text)
    t0 = time.perf_counter()
    with jax.profiler.trace(str(log_dir)):
        for fn in (ar, ver):
            for _ in range(steps):
                jax.block_until_ready(fn())  # one step at a time, as the decode loop waits on each
    log(f"traced {steps} AR and {steps} verify({bucket}) steps at context {context} "
        f"({time.perf_counter() - t0:.1f} s with the profiler) into {log_dir}")
    # (On a GPU, XLA may run steps without its command buffers (CUDA graphs) while a profiler is on: the
    # kernels' own durations hold, the gaps between them may be larger than in the timed runs.)
    return write(log_dir, f"Step trace: AR and verify({bucket}) at context {context} (on a GPU, the gaps between "
                 "kernels may include launches that CUDA graphs hide when no profiler runs)", context=context,
                 bucket=bucket, steps=steps, cache_len=cache_len)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a profiler log dir (the newest *.trace.json.gz under it) or the file itself")
    p.add_argument("--top", type=int, default=25, help="ops listed per program (default 25)")
    p.add_argument("--json", help="also write the summary here")
    args = p.parse_args(argv)
    try:
        s = summarise(args.trace, args.top)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=2) + "\n")
    print(markdown(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
