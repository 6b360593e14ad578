"""Why does a step compile slowly on this backend? Compile times of the decoding steps under XLA flag variants.

    python -m benchmarks.compile_probe                        # qwen3-8b shapes, every variant, 120 s each
    python -m benchmarks.compile_probe --arch smollm2-135m --layers 2 --prompt 64 --cache-len 256 \\
        --variants default,no-constant-folding --out-dir /tmp/cp   # smoke (CPU)

Each variant runs in its own process with its XLA_FLAGS and a timeout, and compiles from abstract
arguments (`jax.ShapeDtypeStruct` weights: an 8B shape costs no memory) the steps a tree request
needs, in this order: AR `prefill`, `tree_prefill`, AR `decode`, `tree_step(--bucket)`. Each
step's lower and compile seconds are printed as soon as it is done, so a variant stopped by its
timeout still reports what it finished. Why: on an H100 (2026-11-26) `tree_prefill` at Qwen3-8B
shapes (prompt 2048, cache 4096) compiled for over 200 s where the 2-core CPU takes 6.4 s; the
variant that is fast names the XLA:GPU pass to blame (autotuning, loop unrolling, constant folding,
the scanned layout). With scanned layers (`--scan yes`; unrolled is the default) the compile does not
grow with depth, so `--layers 4` probes the same layer body in less time.
Each step's optimised HLO size, loop count and scratch memory are reported (scratch that grows
with --cache-len means XLA copies a KV cache every step: on an H100 the SmolLM2 AR step at batch 128
took 0.3 s, to be explained); `--dump` writes the optimised HLO of each step under --out-dir.
Writes <name>.json and <name>.md (device, date, commit, a row per variant).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# name -> (XLA_FLAGS added to the environment's, GPU only, the child's extra arguments). Flags a
# backend does not know are an error there, so GPU-only variants are skipped off GPUs.
VARIANTS = {
    "default": ("", False, []),
    "autotune-0": ("--xla_gpu_autotune_level=0", True, []),
    "no-loop-unrolling": ("--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_NO_UNROLL", True, []),
    "no-constant-folding": ("--xla_disable_hlo_passes=constant_folding", False, []),
    "unrolled": ("", False, ["--scan", "no"]),  # the target's layers unrolled whatever --scan says
    "no-triton-gemm": ("--xla_gpu_enable_triton_gemm=false", True, []),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3-8b", help="named architecture (bastion_jax.presets)")
    p.add_argument("--layers", type=int, help="keep only the first N target layers")
    p.add_argument("--scan", choices=["auto", "yes", "no"], default="auto",
                   help="target layer layout (auto: what loading the architecture picks)")
    p.add_argument("--prompt", type=int, default=2048, help="prefill bucket (default 2048)")
    p.add_argument("--cache-len", type=int, default=4096)
    p.add_argument("--bucket", type=int, default=64, help="tree size of the tree step (default 64)")
    p.add_argument("--batch", type=int, default=1, help="rows per step (default 1)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per variant (default 120)")
    p.add_argument("--dump", action="store_true", help="also write each step's optimised HLO (default variant)")
    p.add_argument("--name", help="results file stem (default <backend>-<arch>-compile-probe)")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--child", help=argparse.SUPPRESS)  # run one variant in this process
    return p


KERNEL_OPS = re.compile(r"= \S+ (?:fusion|custom-call|sort|scatter|gather|while)\(")


def count_kernels(hlo_text: str) -> int:
    """Roughly how many kernels an optimised HLO module emits (fusions, custom calls, sorts, scatters,
    gathers, loops): XLA:GPU's compile time follows this count far more than the model's size."""
    return len(KERNEL_OPS.findall(hlo_text))


def child(args) -> int:
    """Compile the steps in this process (its XLA_FLAGS set by the parent); one JSON line per step."""
    import jax
    import jax.numpy as jnp

    from benchmarks.compile_time import abstract_steps
    from bastion_jax import decoding, tree_decoding
    from bastion_jax.presets import preset_configs

    dtype = getattr(jnp, args.dtype)
    layers = args.layers or preset_configs(args.arch)[0].num_hidden_layers
    scan = {"yes": True, "no": False}.get(args.scan)  # None: the loaders' default layout
    b = args.batch
    cfg, tparams, dparams, tcache, dcache, key, tcfg = abstract_steps(args.arch, layers, dtype, scan, args.bucket,
                                                                      args.cache_len, b)
    rows = jax.ShapeDtypeStruct((b,), jnp.int32)
    flags = jax.ShapeDtypeStruct((b,), bool)
    prompt = jax.ShapeDtypeStruct((b, args.prompt), jnp.int32)
    small = jax.ShapeDtypeStruct((b, 16), jnp.int32)
    state = jax.eval_shape(lambda *a: tree_decoding.tree_prefill(cfg, *a)[0], tparams, dparams, tcache, dcache,
                           small, rows, key)
    print(json.dumps({"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "layers": layers,
                      "scan": tcfg.scan_layers}), flush=True)
    steps = [("prefill", decoding.prefill, (cfg, tparams, tcache, prompt, rows, key), {}),
             ("tree_prefill", tree_decoding.tree_prefill, (cfg, tparams, dparams, tcache, dcache, prompt, rows, key), {}),
             ("decode", decoding.decode, (cfg, tparams, tcache, rows, rows, key, flags), {}),
             (f"tree_step({args.bucket})", tree_decoding.tree_step, (cfg, tparams, dparams, state, flags, key),
              {"bucket": args.bucket})]
    for name, fn, fargs, static in steps:
        t0 = time.perf_counter()
        lowered = fn.lower(*fargs, **static)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        text = compiled.as_text() or ""
        mem = compiled.memory_analysis()
        temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
        print(json.dumps({"step": name, "lower_s": t1 - t0, "compile_s": t2 - t1, "hlo_chars": len(text),
                          "kernels": count_kernels(text), "while_loops": text.count(" while("), "temp_bytes": temp}),
              flush=True)
        if args.dump:
            stem = name.replace("(", "-").replace(")", "")
            Path(args.out_dir, f"{stem}.optimized.hlo.txt").write_text(text)
    return 0


def run_variant(args, variant: str) -> dict:
    """One variant in a subprocess: its steps' timings, and whether it finished in time."""
    extra, _, child_args = VARIANTS[variant]
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), extra) if f)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # every variant really compiles
    cmd = [sys.executable, "-m", "benchmarks.compile_probe", "--child", variant, "--arch", args.arch,
           "--prompt", str(args.prompt), "--cache-len", str(args.cache_len), "--bucket", str(args.bucket),
           "--batch", str(args.batch),
           "--dtype", args.dtype, "--scan", args.scan, "--out-dir", args.out_dir, *child_args]
    if args.layers:
        cmd += ["--layers", str(args.layers)]
    if args.dump and variant == "default":
        cmd.append("--dump")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout,
                              cwd=Path(__file__).resolve().parent.parent)
        out, err, status = proc.stdout, proc.stderr, ("ok" if proc.returncode == 0 else f"exit {proc.returncode}")
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, status = "", f"timeout {args.timeout:.0f} s"
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    res = {"variant": variant, "xla_flags": extra, "status": status, "wall_s": time.perf_counter() - t0,
           "info": rows[0] if rows else {}, "steps": {r["step"]: r for r in rows[1:]}}
    if status.startswith("exit"):
        res["error"] = err.strip().splitlines()[-1:] or [""]
    return res


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    # Compiles only: no process of the probe takes the GPU's memory up front (JAX's default), so the
    # children's autotuning finds it free.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.child:
        return child(args)
    import jax

    from benchmarks.report import commit

    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"error: unknown variant {unknown[0]!r} (one of {', '.join(VARIANTS)})")
    backend = jax.default_backend()
    skipped = [v for v in variants if VARIANTS[v][1] and backend != "gpu"]
    results = []
    for v in variants:
        if v in skipped:
            continue
        r = run_variant(args, v)
        results.append(r)
        print(f"{v}: {r['status']}, " + ", ".join(f"{s} {d['compile_s']:.1f} s" for s, d in r["steps"].items()),
              flush=True)
    meta = {"device": jax.devices()[0].device_kind, "backend": backend, "date": datetime.date.today().isoformat(),
            "commit": commit(), "arch": args.arch, "layers": args.layers, "prompt": args.prompt,
            "cache_len": args.cache_len, "bucket": args.bucket, "batch": args.batch, "dtype": args.dtype,
            "timeout_s": args.timeout,
            "skipped_off_gpu": skipped}
    name = args.name or f"{backend}-{args.arch}-compile-probe"
    steps = ["prefill", "tree_prefill", "decode", f"tree_step({args.bucket})"]
    lines = [f"# {name}", "", f"{meta['device']}, {meta['date']}, commit {meta['commit']}, {args.arch} shapes, "
             f"{args.dtype}, batch {args.batch}, prompt {args.prompt}, cache {args.cache_len}, abstract weights; "
             f"compile seconds (kernels, while loops, scratch MB); '-' = not reached in "
             f"{args.timeout:.0f} s. Scratch that grows with --cache-len is a copy of the KV cache.", "",
             "| variant | status | " + " | ".join(steps) + " |", "|---|---|" + "---|" * len(steps)]
    for r in results:
        cells = []
        for s in steps:
            d = r["steps"].get(s)
            mb = "?" if d is None or d.get("temp_bytes") is None else f"{d['temp_bytes'] / 2**20:.1f}"
            cells.append("-" if d is None else f"{d['compile_s']:.1f} ({d['kernels']}, {d['while_loops']}, {mb})")
        lines.append(f"| {r['variant']} | {r['status']} | " + " | ".join(cells) + " |")
    if skipped:
        lines += ["", f"GPU-only variants skipped on {backend}: {', '.join(skipped)}."]
    out = Path(args.out_dir)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "variants": results}, indent=2) + "\n")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
