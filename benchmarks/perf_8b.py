"""GPU performance check at 8B shape: the issue-6 ratios, all measured in one run, with pass/fail.

    python -m benchmarks.perf_8b                                  # qwen3-8b shapes, bf16, random weights
    python -m benchmarks.perf_8b --arch llama3.1-8b --name perf-llama3.1-8b-h100
    python -m benchmarks.perf_8b --arch smollm2-135m --layers 1 --drafter-layers 1 --block-size 4 \
        --buckets 1,4 --contexts 16,32 --reps 1 --out-dir /tmp/perf      # CPU smoke run (tests)

Ratios (targets from the issue):
  AR step vs HBM floor     floor / AR step, floor = (weight bytes the step reads: not the embedding
                           table unless tied to the LM head + live KV bytes at c) / measured copy
                           bandwidth; per context, the minimum is judged                        >= 0.85
  verify(b) / AR step      verify-only time of a b-node tree over the AR step at the same context;
                           the maximum over contexts is judged at b = 64 and b = 256   <= 1.10, <= 1.5
  calibrated model error   RMSE(calibrated - measured step) / mean measured step, over buckets x
                           contexts (in-sample: the fit uses the same cells)                    <= 5%
  host overhead / step     (engine loop iteration - device time) / loop iteration, mean over cells <= 3%
  compilations after warm-up  during all timing, plus inside a real `engine.generate` bastion loop  == 0

Writes benchmarks/results/<name>.json (ratios, criteria, every cell, device, date) and <name>.md
(+ <name>.png, the profiler's plot). Timings come from `bastion_jax.profiler.run_profile`, so this
script and the profiler measure the same things.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from bastion_jax.cli import Parser, block_size_arg, fail, stderr_log
from bastion_jax.profile import add_layout_flag

RESULTS = Path(__file__).resolve().parent / "results"

AR_FLOOR_MIN = 0.85
VERIFY_MAX = {64: 1.10, 256: 1.5}
CALIBRATION_MAX = 0.05
HOST_MAX = 0.03


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m benchmarks.perf_8b", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default=None, help="named architecture, random weights (default qwen3-8b unless "
                   "--target is given)")
    p.add_argument("--target", help="a real target checkpoint instead of --arch")
    p.add_argument("--drafter", help="with --target: drafter dir or 'random'")
    p.add_argument("--layers", type=int, help="--arch: keep only the first N target layers")
    p.add_argument("--drafter-layers", type=int)
    p.add_argument("--block-size", type=block_size_arg, help="drafter block size, >= 2 (--arch: the preset's; "
                   "--target: of its random drafter, default 16)")
    add_layout_flag(p)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: --target's own dtype; --arch: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--buckets", default="1,16,64,256")
    p.add_argument("--contexts", default="1024,2048,4096")
    p.add_argument("--max-len", type=int)
    p.add_argument("--tree-top-k", type=int, default=128, help="tree width (drafter candidates per position)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--copy-mib", type=int)
    p.add_argument("--matmul-n", type=int)
    p.add_argument("--gen-tokens", type=int, default=32, help="new tokens of the real bastion loop (default 32)")
    p.add_argument("--prefix-attention", default="auto", choices=["auto", "xla", "pallas"],
                   help="how steps read the committed prefix: auto (the Pallas kernel on GPU, the XLA loop "
                        "elsewhere), xla (the chunked loop), pallas (the kernel); run twice to compare")
    p.add_argument("--compilation-cache", help="JAX persistent compilation cache dir (re-runs skip compiles)")
    p.add_argument("--name", help="results file stem (default perf-<arch>-<device>)")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--trace", metavar="DIR", help="also trace a few AR and verify(largest bucket) steps at the "
                   "longest context with jax.profiler into DIR and summarise them per XLA op (`benchmarks.step_trace`: "
                   "DIR/step-trace.md)")
    p.add_argument("--trace-steps", type=int, default=5, help="steps of each kind traced (default 5)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a criterion fails")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p


def kv_bytes(cfg, context: int, dtype) -> int:
    """K and V of every layer for `context` committed tokens of a model computing in `dtype`: what an
    AR step must read, at the bytes the cache holds them in (`cache.storage_dtype`)."""
    from bastion_jax.modeling.cache import storage_dtype

    itemsize = storage_dtype(dtype).itemsize
    return 2 * cfg.num_hidden_layers * context * cfg.num_key_value_heads * cfg.head_dim * itemsize


def step_weight_bytes(target) -> int:
    """Weight bytes an AR step of the target reads: every parameter except the embedding table, of which
    a step gathers one row per token (the table is read whole only when it is also the LM head: tied)."""
    import jax

    total = sum(x.nbytes for x in jax.tree.leaves(target.state))
    if "lm_head" in target.state:  # untied: the embedding table is only gathered from
        total -= target.state["embed_tokens"]["weight"][...].nbytes
    return total


def draft_weight_bytes(engine) -> int:
    """Weight bytes a draft reads on top of the target's: the drafter's own layers and projection, the
    LM head rows it scores (the draft vocabulary's N rows, or the target's whole head) and one
    embedding row per block slot (negligible, not counted)."""
    import jax

    if engine.drafter is None:
        return 0
    own = sum(x.nbytes for x in jax.tree.leaves(engine.executables.drafter_params))
    dv = engine.draft_vocab
    if dv is not None:
        return own + dv.weight.nbytes
    state = engine.executables.target_params
    return own + (state["lm_head"] if "lm_head" in state else state["embed_tokens"])["weight"].nbytes


def ratios(engine, prof) -> dict:
    """Every ratio of the module docstring from one profile."""
    cfg = engine.target.config
    weights = step_weight_bytes(engine.target)
    bandwidth = engine.latency.peaks.bandwidth
    floor = {c: (weights + kv_bytes(cfg, c, engine.target.dtype)) / bandwidth for c in prof.ar_step_s}
    draft_weights = draft_weight_bytes(engine)
    # A tree step reads the target's weights once (every node in one forward) plus the drafter's.
    step_floor = {(p.bucket, p.context): floor[p.context] + draft_weights / bandwidth for p in prof.points}
    verify = {(p.bucket, p.context): p.verify_s / prof.ar_step_s[p.context] for p in prof.points}
    # The host's share of the loop each policy runs at b (bastion; fixed:b), the worse of the two.
    host = [max(p.host_s / p.loop_s, p.fixed_host_s / p.fixed_loop_s) for p in prof.points]
    return {
        "weight_bytes": weights,
        "bandwidth": bandwidth,
        "hbm_floor_s": {str(c): f for c, f in floor.items()},
        "ar_step_s": {str(c): t for c, t in prof.ar_step_s.items()},
        "ar_floor_ratio": {str(c): floor[c] / t for c, t in prof.ar_step_s.items()},
        "draft_weight_bytes": draft_weights,
        "tree_step_floor_ratio": {f"{p.bucket}@{p.context}": step_floor[(p.bucket, p.context)] / p.device_s
                                  for p in prof.points},
        "verify_over_ar": {f"{b}@{c}": r for (b, c), r in verify.items()},
        "calibration_rmse_over_mean": prof.calibration_error,
        "host_overhead_frac": {f"{p.bucket}@{p.context}": h for p, h in zip(prof.points, host)},
        "host_overhead_frac_mean": sum(host) / len(host),
        "host_overhead_frac_max": max(host),
        "compilations_during_timing": prof.compilations_during_timing,
    }


def criteria(r: dict, buckets) -> list[dict]:
    """[{name, value, target, pass}] (pass None when the bucket was not measured)."""
    out = [{"name": "AR step vs HBM floor (min over contexts)", "value": min(r["ar_floor_ratio"].values()),
            "target": f">= {AR_FLOOR_MIN}", "pass": min(r["ar_floor_ratio"].values()) >= AR_FLOOR_MIN}]
    for b, limit in VERIFY_MAX.items():
        vals = [v for k, v in r["verify_over_ar"].items() if int(k.split("@")[0]) == b]
        value = max(vals) if vals else None
        out.append({"name": f"verify({b}) / AR step (max over contexts)", "value": value, "target": f"<= {limit}",
                    "pass": None if value is None else value <= limit})
    out.append({"name": "calibrated model error (RMSE / mean)", "value": r["calibration_rmse_over_mean"],
                "target": f"<= {CALIBRATION_MAX}", "pass": r["calibration_rmse_over_mean"] <= CALIBRATION_MAX})
    out.append({"name": "host overhead / step (mean over cells)", "value": r["host_overhead_frac_mean"],
                "target": f"<= {HOST_MAX}", "pass": r["host_overhead_frac_mean"] <= HOST_MAX})
    comp = r["compilations_during_timing"] + r["compilations_in_generate_loop"]
    out.append({"name": "compilations after warm-up", "value": comp, "target": "== 0", "pass": comp == 0})
    return out


def _fmt(v) -> str:
    if v is None:
        return "not measured"
    return str(v) if isinstance(v, int) else f"{v:.4g}"


def markdown(meta: dict, r: dict, crit: list[dict], prof) -> str:
    buckets = sorted({p.bucket for p in prof.points})
    lines = [f"# {meta['name']}", "",
             f"{meta['device']}, {meta['date']}, {meta['dtype']}, {meta['label']} ({meta['target_layers']} target "
             f"layers, {meta['layers_layout']}), cache {prof.cache_len} slots, batch 1, median of {meta['reps']}", "",
             f"Measured copy bandwidth {r['bandwidth'] / 1e9:.1f} GB/s, matmul {meta['peaks']['flops'] / 1e12:.2f} "
             f"TFLOP/s; weights {r['weight_bytes'] / 2**30:.2f} GiB. The floor counts the KV of the live context, "
             f"which is all the attention reads (`attention.attend_split`), whatever the cache size. Committed "
             f"prefix read by: {meta.get('prefix_attention', {}).get('target_steps', 'xla')} "
             f"(--prefix-attention {meta.get('prefix_attention', {}).get('mode', 'auto')}).",
             "",
             "| criterion | value | target | pass |", "|---|---|---|---|"]
    for c in crit:
        ok = "n/a" if c["pass"] is None else ("yes" if c["pass"] else "NO")
        lines.append(f"| {c['name']} | {_fmt(c['value'])} | {c['target']} | {ok} |")
    lines += ["", "| context | AR step ms | HBM floor ms | floor / AR | "
              + " | ".join(f"verify({b}) / AR" for b in buckets) + " |",
              "|---|---|---|---|" + "---|" * len(buckets)]
    for c, t in r["ar_step_s"].items():
        cells = " | ".join(f"{r['verify_over_ar'][f'{b}@{c}']:.3f}" for b in buckets)
        lines.append(f"| {c} | {t * 1e3:.3f} | {r['hbm_floor_s'][c] * 1e3:.3f} | {r['ar_floor_ratio'][c]:.3f} | "
                     f"{cells} |")
    lines += ["", f"Tree step floor: the AR floor + the draft's weights ({r['draft_weight_bytes'] / 2**20:.1f} MiB: the "
              "drafter and the LM head rows it scores) / bandwidth.", "",
              "| bucket | context | step ms | device ms | floor / device | verify ms | draft ms | host % (worse of "
              "bastion, fixed:b) | "
              "calibrated error % |", "|---|---|---|---|---|---|---|---|---|"]
    for p in prof.points:
        lines.append(f"| {p.bucket} | {p.context} | {p.step_s * 1e3:.3f} | {p.device_s * 1e3:.3f} | "
                     f"{r['tree_step_floor_ratio'][f'{p.bucket}@{p.context}']:.3f} | "
                     f"{p.verify_s * 1e3:.3f} | {p.draft_s * 1e3:.3f} | "
                     f"{100 * r['host_overhead_frac'][f'{p.bucket}@{p.context}']:.2f} | "
                     f"{100 * (p.calibrated_s - p.step_s) / p.step_s:+.2f} |")
    lines += ["", f"Real bastion loop ({meta['generate']['new_tokens']} tokens): "
              f"{meta['generate']['tokens_per_s']:.1f} tok/s, {meta['generate']['compilations']} compilations at "
              f"warm-up, {meta['generate']['compilations_after_warmup']} after."]
    return "\n".join(lines) + "\n"


def setup_models(args, log):
    """The start perf_8b and verify_probe share: Qwen3-8B shapes unless told otherwise, the persistent
    compilation cache, the prefix attention mode, and the models built as `python -m bastion_jax.profile`
    builds them (its `setup`, with measured peaks). Raises one of `run_errors()`."""
    import jax

    from bastion_jax.modeling.attention import set_prefix_kernel
    from bastion_jax.profile import setup

    if args.arch is None and args.target is None:
        args.arch = "qwen3-8b"
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
    args.peaks = "measure"  # the profiler's flag: setup measures copy bandwidth and matmul rate
    set_prefix_kernel(args.prefix_attention)
    return setup(args, log)


def run_errors() -> tuple[type[Exception], ...]:
    """The bad-input errors a run reports as one line."""
    from bastion_jax.checkpoints import CheckpointError
    from bastion_jax.config import ConfigError
    from bastion_jax.engine import GenerationError
    from bastion_jax.profile import ProfileError

    return ProfileError, CheckpointError, ConfigError, GenerationError, ValueError


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = stderr_log(args.quiet)

    from bastion_jax.modeling.attention import prefix_kernel_mode
    from bastion_jax.profile_report import device_meta, plot
    from bastion_jax.profiler import run_profile

    try:
        s = setup_models(args, log)
        engine = s.engine
        prof = run_profile(engine, s.contexts, s.cache_len, reps=args.reps, warmup=args.warmup,
                           progress=not args.quiet)
        r = ratios(engine, prof)
        meta = device_meta(engine, s.label, s.model_name, args.reps, args.warmup)
        tcfg = engine.target.config
        meta["prefix_attention"] = {"mode": args.prefix_attention,
                                    "target_steps": prefix_kernel_mode(tcfg.head_dim, s.cache_len) or "xla"}
        # The real decode loop, with everything already compiled: its own compile counters must stay 0.
        res = engine.generate([[1] * 16], max_new_tokens=args.gen_tokens, mode="bastion", max_len=s.cache_len)
    except run_errors() as e:
        return fail(e)
    st = res.stats
    r["compilations_in_generate_loop"] = st.compilations + st.compilations_after_warmup
    name = args.name or f"perf-{s.label}-{meta['device'].lower().replace(' ', '-')}"
    meta.update(name=name, generate={"new_tokens": st.new_tokens, "tokens_per_s": st.tokens_per_s, "tau": st.tau,
                                     "compilations": st.compilations,
                                     "compilations_after_warmup": st.compilations_after_warmup,
                                     "buckets": {str(b): n for b, n in st.buckets.items()}})
    crit = criteria(r, engine.buckets)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(
        {"meta": meta, "ratios": r, "criteria": crit, "cache_len": prof.cache_len, "compile_s": prof.compile_s,
         "points": [dataclasses.asdict(p) for p in prof.points]}, indent=2))
    text = markdown(meta, r, crit, prof)
    (out_dir / f"{name}.md").write_text(text)
    plot(prof, out_dir / f"{name}.png", f"{name}: {s.label} on {meta['device']} ({meta['dtype']})")
    print(text, end="")
    print(f"wrote {out_dir / name}.json, .md, .png")
    if args.trace:  # after the results are written: a trace that fails or runs out of time loses nothing else
        from benchmarks.step_trace import take

        take(engine, s.cache_len, max(s.contexts), max(engine.buckets), args.trace_steps, args.trace, log)
    failed = [c["name"] for c in crit if c["pass"] is False]
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
