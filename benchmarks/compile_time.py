"""Compile time of the decoding steps against the target's depth, with no weights at all.

    python -m benchmarks.compile_time                          # qwen3-8b shapes: 4 vs 36 target layers
    python -m benchmarks.compile_time --arch smollm2-135m --layers 1,2 --bucket 4 --out-dir /tmp/ct   # smoke

Every step is lowered and compiled from abstract arguments (`jax.ShapeDtypeStruct` parameters,
caches and state: `jit(step).lower(...).compile()`), so an 8B shape costs no memory. Reported per
depth: lower and compile seconds of the AR decode step and of a tree step at `--bucket`, and the
ratio deepest / shallowest (issue 14's target: 36 layers within 1.5x of 4 once layers are scanned),
for each layer layout in `--layouts` (unrolled and scanned by default).
Writes benchmarks/results/<name>.json and <name>.md with device, date and commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

RESULTS = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3-8b", help="named architecture (bastion_jax.presets)")
    p.add_argument("--layers", default="4,36", help="target depths to compare (default 4,36)")
    p.add_argument("--layouts", default="unrolled,scanned", help="layer layouts to time (default unrolled,scanned)")
    p.add_argument("--bucket", type=int, default=64, help="tree size of the tree step (default 64)")
    p.add_argument("--cache-len", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--name", help="results file stem (default <backend>-<arch>-compile-time)")
    p.add_argument("--out-dir", default=str(RESULTS))
    return p


def abstract_pair(arch: str, layers: int, dtype, scan: bool = False):
    """(target graphdef, drafter graphdef, abstract target params, abstract drafter params, configs)."""
    from flax import nnx

    from bastion_jax.modeling.drafter import Drafter
    from bastion_jax.modeling.transformer import Transformer
    from bastion_jax.checkpoints import layer_layout
    from bastion_jax.presets import preset_configs

    tcfg, dcfg = preset_configs(arch, layers)
    tcfg = layer_layout(tcfg, scan, dtype=dtype)
    dcfg = layer_layout(dcfg, tcfg.scan_layers, feature_major=tcfg.feature_major)  # as load_drafter lays it out
    t = nnx.eval_shape(lambda: Transformer(tcfg, dtype=dtype, rngs=nnx.Rngs(0)))
    d = nnx.eval_shape(lambda: Drafter(dcfg, dtype=dtype, rngs=nnx.Rngs(1)))
    (tdef, tstate), (ddef, dstate) = nnx.split(t), nnx.split(d)
    return tdef, ddef, nnx.to_pure_dict(tstate), nnx.to_pure_dict(dstate), tcfg, dcfg


class AbstractSteps(NamedTuple):
    """Everything a step's `lower` takes, as shapes: the static config, parameters, caches, a key."""
    cfg: Any
    tparams: Any
    dparams: Any
    tcache: Any
    dcache: Any
    key: Any
    tcfg: Any


def abstract_steps(arch: str, layers: int, dtype, scan: bool | None, bucket: int, cache_len: int,
                   batch: int = 1) -> AbstractSteps:
    """The pair from shapes only (`abstract_pair`), its StepConfig with one tree bucket, caches of
    `cache_len` slots for `batch` rows and a greedy key: what compile_time and compile_probe lower."""
    import jax

    from bastion_jax.modeling.cache import KVCache
    from bastion_jax.sampling import SamplingConfig, sampler
    from bastion_jax.step_config import StepConfig

    tdef, ddef, tparams, dparams, tcfg, dcfg = abstract_pair(arch, layers, dtype, scan)
    cfg = StepConfig(target_def=tdef, drafter_def=ddef, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                     tap_layers=tuple(dcfg.target_layer_ids), buckets=(bucket,), top_k=8)
    key = sampler(jax.random.PRNGKey(0), SamplingConfig())
    tcache = jax.eval_shape(lambda: KVCache.create(tcfg, batch, cache_len, dtype))
    dcache = jax.eval_shape(lambda: KVCache.create(dcfg, batch, cache_len, dtype))
    return AbstractSteps(cfg, tparams, dparams, tcache, dcache, key, tcfg)


def time_compiles(arch: str, layers: int, bucket: int, cache_len: int, dtype, scan: bool = False) -> dict:
    """Lower and compile seconds of `decode` and `tree_step` (bucket) for one depth, from shapes only."""
    import jax
    import jax.numpy as jnp

    from bastion_jax import decoding, tree_decoding

    cfg, tparams, dparams, tcache, dcache, key, _ = abstract_steps(arch, layers, dtype, scan, bucket, cache_len)
    rows = jax.ShapeDtypeStruct((1,), jnp.int32)
    out = {"layers": layers, "layout": "scanned" if scan else "unrolled"}

    def measure(name, fn, *args, **static):
        t0 = time.perf_counter()
        lowered = fn.lower(*args, **static)
        t1 = time.perf_counter()
        lowered.compile()
        out[name] = {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1}

    measure("decode", decoding.decode, cfg, tparams, tcache, rows, rows, key, jax.ShapeDtypeStruct((1,), bool))
    prompt = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    state = jax.eval_shape(lambda *a: tree_decoding.tree_prefill(cfg, *a)[0], tparams, dparams, tcache, dcache,
                           prompt, rows, key)
    measure(f"tree_step({bucket})", tree_decoding.tree_step, cfg, tparams, dparams, state,
            jax.ShapeDtypeStruct((1,), bool), key, bucket=bucket)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import jax
    import jax.numpy as jnp

    from benchmarks.report import commit

    depths = sorted(int(x) for x in args.layers.split(","))
    layouts = [x for x in args.layouts.split(",") if x]
    if not layouts or set(layouts) - {"unrolled", "scanned"}:
        raise SystemExit(f"error: --layouts takes unrolled and/or scanned, got {args.layouts!r}")
    by_layout = {lay: [time_compiles(args.arch, n, args.bucket, args.cache_len, getattr(jnp, args.dtype),
                                     lay == "scanned") for n in depths] for lay in layouts}
    runs = [r for rs in by_layout.values() for r in rs]
    steps = [k for k in runs[0] if k not in ("layers", "layout")]
    ratios = {lay: {s: {k: rs[-1][s][k] / rs[0][s][k] for k in ("lower_s", "compile_s")} for s in steps}
              for lay, rs in by_layout.items()}
    meta = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "date": datetime.date.today().isoformat(), "commit": commit(), "arch": args.arch, "dtype": args.dtype,
            "cache_len": args.cache_len, "bucket": args.bucket}
    name = args.name or f"{meta['backend']}-{args.arch}-compile-time"
    lines = [f"# {name}", "", f"{meta['device']}, {meta['date']}, commit {meta['commit']}, {args.arch} shapes, "
             f"{args.dtype}, cache {args.cache_len}, abstract weights (nothing allocated).", "",
             "| layers | target layers | " + " | ".join(f"{s} lower s | {s} compile s" for s in steps) + " |",
             "|---|---|" + "---|---|" * len(steps)]
    for r in runs:
        lines.append(f"| {r['layout']} | {r['layers']} | " + " | ".join(f"{r[s]['lower_s']:.2f} | {r[s]['compile_s']:.2f}"
                                                                    for s in steps) + " |")
    lines.append("")
    for lay, rs in ratios.items():
        lines.append(f"Ratio {depths[-1]} / {depths[0]} layers, {lay} (target: compile <= 1.5 with scanned layers): "
                     + ", ".join(f"{s}: lower {r['lower_s']:.2f}x, compile {r['compile_s']:.2f}x" for s, r in rs.items()))
    lines.append("")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "runs": runs, "ratios": ratios}, indent=2) + "\n")
    (out / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
