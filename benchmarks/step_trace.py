"""Where a step's device time goes: a `jax.profiler` trace of a few AR and verify(b) steps, per XLA op.

    python -m benchmarks.perf_8b --buckets 1,64 --contexts 2048 --trace DIR     # take one (also verify_probe)
    python -m benchmarks.step_trace DIR [--top 25]        # summarise a trace taken earlier, on any machine

Why: on an H200 the AR step at Qwen3-8B shapes ran at 0.57 of its HBM floor and verify(64) at 1.25-1.30
AR steps (issue 14's goals: 0.85 and 1.10), and a timing says how long, not where. A trace of the
compiled steps names every kernel with its XLA op (`hlo_op`) and program (`hlo_module`), so one lease's
trace, summarised on the CPU afterwards, shows which ops hold the time: the products, the prefix
attention, the tree part, copies, or the gaps between kernels (device busy time against wall time).

`take` runs `steps` AR steps and `steps` verify(b) steps at one context under the profiler (the
executables already compiled by the caller's measurements); `summarise` reads the `*.trace.json.gz`
the profiler writes (Chrome trace events: `ph` X with `dur` in microseconds, `args.hlo_op` /
`args.hlo_module` on every op) and reports, per program, its executions, device time per execution and
the ops with the largest share. On a GPU only the device's own tracks (`/device:...`) are counted (the
host's launch events carry the same op names); on CPU the ops run on host threads and all are counted.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

KINDS = (("product", ("gemm", "dot", "cublas", "matmul", "ynn", "cutlass", "onednn")),
         ("attention", ("prefix", "attention", "softmax", "mosaic", "pallas")),
         ("copy", ("copy", "transpose", "dynamic-update-slice", "dynamic_update_slice", "memcpy", "memset")),
         ("reduce", ("reduce",)), ("fusion", ("fusion",)))


def kind(name: str) -> str:
    """A coarse class of an op from its name (first match in KINDS, else "other")."""
    low = name.lower()
    for k, keys in KINDS:
        if any(key in low for key in keys):
            return k
    return "other"


def trace_file(path: str | Path) -> Path:
    """The newest `*.trace.json.gz` under `path` (a profiler log dir) or `path` itself."""
    p = Path(path)
    if p.is_file():
        return p
    found = sorted(p.glob("**/*.trace.json.gz"), key=lambda f: f.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {p}")
    return found[-1]


def op_events(trace: dict) -> list[dict]:
    """The op events of a Chrome trace: complete events (`ph` X) that name an XLA op, on the device's
    own tracks when there are any (GPU), else everywhere (CPU: ops run on host threads); of nested
    events (a `while` op around its body's ops on CPU) only the innermost, so no time counts twice."""
    procs = {e.get("pid"): (e.get("args") or {}).get("name", "") for e in trace.get("traceEvents", [])
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in procs.items() if str(name).startswith("/device:")}
    tracks: dict[tuple, list[dict]] = defaultdict(list)
    for e in trace.get("traceEvents", []):
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args or str(e.get("name", "")).startswith("end: "):
            continue
        if device and e.get("pid") not in device:
            continue
        tracks[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for evs in tracks.values():  # leaves only: a loop's or a call's event spans its body's ops (CPU)
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        for e, nxt in zip(evs, evs[1:] + [None]):
            if nxt is None or float(nxt["ts"]) >= float(e["ts"]) + float(e.get("dur", 0.0)):
                out.append(e)
    return out


def summarise(path: str | Path, top: int = 25) -> dict:
    """Per program (`hlo_module`): executions (the most common count among its ops: an op outside a
    loop runs once per execution), device time per execution (the sum of its ops' durations; kernels
    on parallel streams would count twice), the span per execution (first op start to last op end,
    gaps included) and its `top` ops by total time, with their share and kind."""
    f = trace_file(path)
    with gzip.open(f, "rt") as fp:
        events = op_events(json.load(fp))
    per_module: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        per_module[e["args"].get("hlo_module", "?")].append(e)
    modules = {}
    for module, evs in per_module.items():
        counts = Counter(e["args"]["hlo_op"] for e in evs)
        runs = Counter(counts.values()).most_common(1)[0][0]
        total = sum(float(e.get("dur", 0.0)) for e in evs)
        by_run: dict[str, list[dict]] = defaultdict(list)
        for e in evs:
            by_run[e["args"].get("run_id", "")].append(e)
        spans = [max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in r) - min(float(e["ts"]) for e in r)
                 for key, r in by_run.items() if key]
        ops: dict[str, dict] = {}
        for e in evs:
            op = e["args"]["hlo_op"]
            o = ops.setdefault(op, {"op": op, "kernel": e.get("name", op), "us": 0.0, "calls": 0})
            o["us"] += float(e.get("dur", 0.0))
            o["calls"] += 1
        ranked = sorted(ops.values(), key=lambda o: -o["us"])
        kinds: dict[str, float] = defaultdict(float)
        for o in ranked:
            kinds[kind(o["kernel"] + " " + o["op"])] += o["us"]
        modules[module] = {
            "executions": runs, "ops": len(ops), "op_events": len(evs), "device_us_per_execution": total / runs,
            "span_us_per_execution": (sum(spans) / len(spans)) if spans else None,
            "kinds_us_per_execution": {k: v / runs for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [dict(o, us_per_execution=o["us"] / runs, share=o["us"] / total if total else 0.0,
                         kind=kind(o["kernel"] + " " + o["op"])) for o in ranked[:top]]}
    return {"trace": str(f), "modules": dict(sorted(modules.items(), key=lambda kv: -kv[1]["device_us_per_execution"]))}


def markdown(s: dict, title: str = "Step trace") -> str:
    lines = [f"# {title}", "", f"From `{s['trace']}` (`python -m benchmarks.step_trace`): device time per "
             "execution = the sum of the program's op durations over its executions; span = first op start "
             "to last op end (gaps between kernels included).", ""]
    for module, m in s["modules"].items():
        span = "n/a" if m["span_us_per_execution"] is None else f"{m['span_us_per_execution'] / 1e3:.3f} ms"
        kinds = ", ".join(f"{k} {v / 1e3:.3f}" for k, v in m["kinds_us_per_execution"].items())
        lines += [f"## {module}", "", f"{m['executions']} executions, {m['ops']} ops; device time "
                  f"{m['device_us_per_execution'] / 1e3:.3f} ms per execution, span {span}; by kind (ms): {kinds}.",
                  "", "| op | kernel | kind | ms per execution | share | calls |", "|---|---|---|---|---|---|"]
        for o in m["top"]:
            lines.append(f"| {o['op']} | {o['kernel'][:60]} | {o['kind']} | {o['us_per_execution'] / 1e3:.4f} | "
                         f"{o['share']:.1%} | {o['calls']} |")
        lines.append("")
    return "\n".join(lines)


def take(engine, cache_len: int, context: int, bucket: int, steps: int, log_dir: str | Path, log=print) -> dict:
    """Trace `steps` AR steps and `steps` verify(bucket) steps (batch 1, one context) under
    `jax.profiler.trace(log_dir)`, after one untraced call of each (their executables come from the
    engine's table: compiled already when the caller measured them). Writes step-trace.md / .json
    beside the trace and returns the summary."""
    import jax
    import numpy as np

    from bastion_jax.sampling import SamplingConfig, sampler
    from benchmarks.verify_probe import sample_tree

    exe, sampling = engine.executables, SamplingConfig()
    ar_step = exe.decode(1, cache_len, sampling)
    verify = exe.verify_steps(1, cache_len, (bucket,))[bucket]
    exe.ready()
    params, key = exe.target_params, sampler(jax.random.PRNGKey(0), sampling)
    tree = sample_tree(exe, engine.block_size - 1, 1, cache_len, engine.top_k)
    box = {"cache": exe.new_cache(1, cache_len)}
    token, active = jax.device_put(np.zeros(1, np.int32)), jax.device_put(np.ones(1, bool))
    length = jax.device_put(np.full(1, context, np.int32))

    def ar():
        box["cache"], nxt = ar_step(params, box["cache"], token, length, key, active)
        return nxt

    def ver():
        choices, box["cache"] = verify(params, box["cache"], tree, length)
        return choices

    jax.block_until_ready(ar())
    jax.block_until_ready(ver())
    log_dir = Path(log_dir)
    t0 = time.perf_counter()
    with jax.profiler.trace(str(log_dir)):
        for fn in (ar, ver):
            for _ in range(steps):
                jax.block_until_ready(fn())  # one step at a time, as the decode loop waits on each
    log(f"traced {steps} AR and {steps} verify({bucket}) steps at context {context} "
        f"({time.perf_counter() - t0:.1f} s with the profiler) into {log_dir}")
    s = summarise(log_dir)
    s.update(context=context, bucket=bucket, steps=steps, cache_len=cache_len)
    (log_dir / "step-trace.json").write_text(json.dumps(s, indent=2) + "\n")
    (log_dir / "step-trace.md").write_text(markdown(s, f"Step trace: AR and verify({bucket}) at context {context}"))
    return s


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
