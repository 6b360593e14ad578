"""The target's side of the GPU ratios alone: AR step vs HBM floor and verify(b) / AR, no tree steps.

    python -m benchmarks.verify_probe                             # qwen3-8b shapes, bf16, random weights
    python -m benchmarks.verify_probe --arch smollm2-135m --layers 1 --buckets 1,4 --contexts 16,32 \
        --reps 1 --out-dir /tmp/probe                             # CPU smoke run (tests)

Why: `perf_8b` times whole tree steps through the profiler, which compiles `tree_prefill` first, and
XLA:GPU once took over 200 s on that at Qwen3-8B shapes, and no lease brought back a ratio until this. It
compiles only the plain AR decode step, the plain b-token forward and `tree_verify(b)` (the target's
forward over a b-node tree with the tree mask, the taps and the accept walk: `Executables.verify_steps`)
and times each alone at every context, so the issue's two target-side ratios come out of any lease:

  AR step vs HBM floor   (weights a step reads + live KV) / measured copy bandwidth, over the AR step
  verify(b) / AR step    per context; judged at b = 64 and b = 256 as in perf_8b

with the prefill of the longest context's prompt and the seconds each executable took to compile.
perf_8b's flags (the profiler's `setup` builds the models) except --gen-tokens (no generation loop
runs here); writes <name>.json and .md with device, date and commit.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from bastion_jax.cli import fail, stderr_log
from benchmarks.perf_8b import (AR_FLOOR_MIN, VERIFY_MAX, build_parser, kv_bytes, run_errors, setup_models,
                                step_weight_bytes)
from benchmarks.report import commit

if TYPE_CHECKING:
    import jax


def sample_tree(exe, depth: int, batch: int, cache_len: int, top_k: int, seed: int = 0):
    """A best-first tree of the steps' shape from random drafter log-probs (every bucket slices a
    valid tree of it; its tokens do not matter to the timing). depth: the block size - 1; top_k: the
    engine's tree width."""
    import jax
    import jax.numpy as jnp

    from bastion_jax.tree import build_tree

    struct = exe.tree_struct(batch, cache_len)
    n = struct.tokens.shape[1]
    vocab = max(top_k, 64)
    lp = jax.nn.log_softmax(jax.random.normal(jax.random.PRNGKey(seed), (batch, depth, vocab)), axis=-1)
    tree = jax.vmap(lambda r, l: build_tree(r, l, n, top_k))(jnp.zeros((batch,), jnp.int32), lp)
    return jax.tree.map(lambda x, s: x.astype(s.dtype), tree, struct)


class TargetSteps:
    """One row's plain AR step and tree_verify(b) steps on a shared cache, called one step at a time
    on the engine's compiled executables with a fixed drafted tree (`sample_tree`): what `measure`
    times and `step_trace.take` traces, so both run exactly the same calls."""

    def __init__(self, engine, cache_len: int, ar_step: Callable, verify: dict[int, Callable]):
        import jax
        import numpy as np

        from bastion_jax.sampling import SamplingConfig, sampler

        exe = engine.executables
        self.ar_step, self.verify_fns = ar_step, verify
        self.params, self.key = exe.target_params, sampler(jax.random.PRNGKey(0), SamplingConfig())
        self.tree = sample_tree(exe, engine.block_size - 1, 1, cache_len, engine.top_k)
        self.cache = exe.new_cache(1, cache_len)
        self.token, self.active = jax.device_put(np.zeros(1, np.int32)), jax.device_put(np.ones(1, bool))

    @staticmethod
    def lengths(context: int) -> jax.Array:
        """The committed length [1] of a step at `context`."""
        import jax
        import numpy as np

        return jax.device_put(np.full(1, context, np.int32))

    def ar(self, length: jax.Array) -> jax.Array:
        """One AR step (not waited on): its next token [1]."""
        self.cache, nxt = self.ar_step(self.params, self.cache, self.token, length, self.key, self.active)
        return nxt

    def verify(self, bucket: int, length: jax.Array) -> jax.Array:
        """One tree_verify(bucket) step (not waited on): the target's choices."""
        self.cache, choices = self.verify_fns[bucket](self.params, self.cache, self.tree, length)
        return choices


def measure(engine, contexts, cache_len: int, reps: int, warmup: int) -> dict:
    """{compile_s, prefill_s, ar_step_s, verify_s, forward_s} at batch 1 (seconds; the prefill of the
    longest context's prompt, the last three per context, and per bucket for verify / forward)."""
    import jax
    import numpy as np

    from bastion_jax.profiler import median_s
    exe, buckets = engine.executables, engine.buckets
    compile_s: dict[str, float] = {}

    def timed(name, make):
        t0 = time.perf_counter()
        out = make()
        exe.ready()  # (compiles run on worker threads)
        compile_s[name] = time.perf_counter() - t0
        return out

    exe.tree_struct(1, cache_len)  # traced here, so that no compile figure below includes the tracing
    prompt = max(contexts)  # the prefill is timed at the longest context's prompt length
    prefill, ar_step = timed(f"ar decode + prefill({prompt})", lambda: exe.ar(1, prompt, cache_len))
    verify = {b: timed(f"tree_verify({b})", lambda b=b: exe.verify_steps(1, cache_len, (b,))[b]) for b in buckets}
    forward = {b: timed(f"forward({b})", lambda b=b: exe.forward(1, cache_len, b)) for b in buckets}
    steps = TargetSteps(engine, cache_len, ar_step, verify)
    params, key = steps.params, steps.key
    result = {"compile_s": compile_s, "ar_step_s": {}, "verify_s": {}, "forward_s": {}}
    prompt_tokens = jax.device_put(np.zeros((1, prompt), np.int32))
    prompt_len = jax.device_put(np.full(1, prompt, np.int32))
    times = []
    for i in range(warmup + reps):  # a fresh cache per call (the prefill donates it), made before the clock starts
        cache = jax.block_until_ready(exe.new_cache(1, cache_len))
        t0 = time.perf_counter()
        jax.block_until_ready(prefill(params, cache, prompt_tokens, prompt_len, key))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    result["prefill_s"] = {str(prompt): statistics.median(times)}
    for c in contexts:
        length = steps.lengths(c)
        result["ar_step_s"][str(c)] = median_s(lambda: jax.block_until_ready(steps.ar(length)), reps, warmup)
        for b in buckets:
            tokens = jax.device_put(np.zeros((1, b), np.int32))

            def ver(b=b):
                jax.block_until_ready(steps.verify(b, length))

            def fwd(b=b, tokens=tokens):
                steps.cache, out = forward[b](params, steps.cache, tokens, length)
                jax.block_until_ready(out)

            result["verify_s"][f"{b}@{c}"] = median_s(ver, reps, warmup)
            result["forward_s"][f"{b}@{c}"] = median_s(fwd, reps, warmup)
    return result


def report(engine, m: dict) -> dict:
    """The ratios and pass / fail of the two target-side criteria."""
    cfg = engine.target.config
    weights, bandwidth = step_weight_bytes(engine.target), engine.latency.peaks.bandwidth
    floor = {c: (weights + kv_bytes(cfg, int(c), engine.target.dtype)) / bandwidth for c in m["ar_step_s"]}
    r = {"weight_bytes": weights, "bandwidth": bandwidth, "hbm_floor_s": floor,
         "ar_floor_ratio": {c: floor[c] / t for c, t in m["ar_step_s"].items()},
         "verify_over_ar": {k: v / m["ar_step_s"][k.split("@")[1]] for k, v in m["verify_s"].items()},
         "forward_over_ar": {k: v / m["ar_step_s"][k.split("@")[1]] for k, v in m["forward_s"].items()}}
    worst = min(r["ar_floor_ratio"].values())
    crit = [{"name": "AR step vs HBM floor (min over contexts)", "value": worst, "target": f">= {AR_FLOOR_MIN}",
             "pass": worst >= AR_FLOOR_MIN}]
    for b, limit in VERIFY_MAX.items():
        vals = [v for k, v in r["verify_over_ar"].items() if int(k.split("@")[0]) == b]
        crit.append({"name": f"verify({b}) / AR step (max over contexts)", "value": max(vals) if vals else None,
                     "target": f"<= {limit}", "pass": (max(vals) <= limit) if vals else None})
    r["criteria"] = crit
    return r


def markdown(meta: dict, m: dict, r: dict) -> str:
    buckets = meta["buckets"]
    lines = [f"# {meta['name']}", "", f"{meta['device']}, {meta['date']}, commit {meta['commit']}, {meta['dtype']}, "
             f"{meta['label']} ({meta['target_layers']} target layers, {meta['layers_layout']}), "
             f"cache {meta['cache_len']} slots, batch 1, "
             f"median of {meta['reps']}. Copy bandwidth {r['bandwidth'] / 1e9:.1f} GB/s (measured), weights a step "
             f"reads {r['weight_bytes'] / 2**30:.2f} GiB. Target side only (`benchmarks.verify_probe`): no drafter, "
             "no tree_prefill compiled.", "", "| criterion | value | target | pass |", "|---|---|---|---|"]
    for c in r["criteria"]:
        ok = "n/a" if c["pass"] is None else ("yes" if c["pass"] else "NO")
        value = "not measured" if c["value"] is None else f"{c['value']:.4g}"
        lines.append(f"| {c['name']} | {value} | {c['target']} | {ok} |")
    lines += ["", "| context | AR step ms | HBM floor ms | floor / AR | "
              + " | ".join(f"verify({b}) / AR (forward)" for b in buckets) + " |",
              "|---|---|---|---|" + "---|" * len(buckets)]
    for c, t in m["ar_step_s"].items():
        cells = " | ".join(f"{r['verify_over_ar'][f'{b}@{c}']:.3f} ({r['forward_over_ar'][f'{b}@{c}']:.3f})"
                           for b in buckets)
        lines.append(f"| {c} | {t * 1e3:.3f} | {r['hbm_floor_s'][c] * 1e3:.3f} | {r['ar_floor_ratio'][c]:.3f} | "
                     f"{cells} |")
    lines += ["", "Prefill: " + ", ".join(f"{n} tokens {t * 1e3:.1f} ms" for n, t in m["prefill_s"].items()) + "."]
    lines += ["", "Compile seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in m["compile_s"].items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    p.prog, p.description = "python -m benchmarks.verify_probe", __doc__
    args = p.parse_args(argv)
    if args.gen_tokens != p.get_default("gen_tokens"):
        return fail(ValueError("--gen-tokens sets perf_8b's generation loop; verify_probe runs none"))
    log = stderr_log(args.quiet)

    import jax

    try:
        s = setup_models(args, log)
        m = measure(s.engine, s.contexts, s.cache_len, args.reps, args.warmup)
    except run_errors() as e:
        return fail(e)
    engine = s.engine
    r = report(engine, m)
    name = args.name or f"verify-probe-{s.label}"
    meta = {"name": name, "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "date": datetime.date.today().isoformat(), "commit": commit(), "label": s.label,
            "dtype": engine.target.dtype.name, "target_layers": engine.target.config.num_hidden_layers,
            "layers_layout": engine.target.config.layers_layout,
            "buckets": list(engine.buckets), "cache_len": s.cache_len, "reps": args.reps, "warmup": args.warmup,
            "prefix_attention": args.prefix_attention, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "measured": m, "ratios": r}, indent=2) + "\n")
    text = markdown(meta, m, r)
    (out / f"{name}.md").write_text(text)
    if not args.quiet:
        print(text, end="")
    log(f"wrote {out / name}.json and .md")
    if args.trace:  # after the results are written (as perf_8b)
        from benchmarks.step_trace import take

        take(s.engine, s.cache_len, max(s.contexts), max(s.engine.buckets), args.trace_steps, args.trace, log)
    failed = [c["name"] for c in r["criteria"] if c["pass"] is False]
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
