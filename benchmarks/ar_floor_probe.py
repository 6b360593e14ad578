"""How close to the HBM floor XLA's own products get at one decode row: the AR step's weight reads alone.

    python -m benchmarks.ar_floor_probe                         # Qwen3-8B shapes, bf16, random weights
    python -m benchmarks.ar_floor_probe --layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 \
        --head-dim 16 --vocab 256 --reps 3 --out-dir /tmp/floor   # CPU smoke run (tests)

Why: on an H200 the model's AR step at Qwen3-8B shapes ran at 0.57 of its HBM floor (verify_probe,
2026-12-04) with attention already following the live context, so the gap is in how the ~250 small
kernels of a step run, not in what they read. This probe times the same weight reads with nothing
else around them, one jitted function per variant:

  separate   per layer q, k, v, o, gate, up, down products (7 kernels' worth, as the model) + the LM head
  fused      q|k|v and gate|up stored side by side: 4 products per layer + the LM head
  norms      `separate` with the two RMSNorms and SwiGLU a layer has (what XLA fuses around products)

Each reads the same bytes, so time / floor says what XLA:GPU reaches with N products per layer. Run it
under XLA flag variants (`gpu_session.sh floor`: command buffers as they are / on for every kind / off)
to see whether launch overhead is the gap: if `separate` here sits near the floor while the model does not,
the model's other kernels are; if `fused` beats `separate`, storing the projections side by side is
worth a checkpoint layout. Writes <name>.json and .md with device, date, commit and XLA_FLAGS.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

from benchmarks.report import commit, write_results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ar_floor_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("layers", 36), ("hidden", 4096), ("intermediate", 12288), ("heads", 32),
                          ("kv-heads", 8), ("head-dim", 128), ("vocab", 151936), ("reps", 20)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--name", default="ar-floor-probe")
    p.add_argument("--out-dir", default="benchmarks/results")
    return p


def make_weights(a, dtype, fused: bool):
    """Per-layer weight dicts ([in, out], as `x @ w`) made on the device by one jitted init."""
    import jax
    import jax.numpy as jnp

    h, q, kv, i = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim, a.intermediate
    shapes = ({"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * i), "down": (i, h)} if fused else
              {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)})

    @jax.jit
    def init(key):
        layers = []
        for layer_key in jax.random.split(key, a.layers):
            keys = jax.random.split(layer_key, len(shapes))
            layers.append({n: (jax.random.normal(k, s, jnp.float32) * s[0] ** -0.5).astype(dtype)
                           for k, (n, s) in zip(keys, shapes.items())})
        head = (jax.random.normal(key, (h, a.vocab), jnp.float32) * h ** -0.5).astype(dtype)  # [h, vocab]
        norms = jnp.ones((a.layers, 2, h), dtype)
        return layers, head, norms

    return init(jax.random.key(0))


def step_fn(a, variant: str):
    """One decode row through every layer's products (and the LM head), residuals kept so that no
    product can be skipped."""
    import jax
    import jax.numpy as jnp

    q, kv, i = a.heads * a.head_dim, a.kv_heads * a.head_dim, a.intermediate

    def rms(x, w):  # [1, h]
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype) * w

    def attn_out(qv, kk, vv):  # stand-in for attention: mixes q with k and v, elementwise, [1, q]
        rep = q // kv
        return qv * jnp.tile(kk + vv, (1, rep))

    @jax.jit
    def step(layers, head, norms, x):  # x: [1, h]
        for n, p in enumerate(layers):
            y = rms(x, norms[n, 0]) if variant == "norms" else x
            if variant == "fused":
                qkv = y @ p["qkv"]  # [1, q + 2 kv]
                a_ = attn_out(qkv[:, :q], qkv[:, q:q + kv], qkv[:, q + kv:])
            else:
                a_ = attn_out(y @ p["q"], y @ p["k"], y @ p["v"])
            x = x + a_ @ p["o"]
            y = rms(x, norms[n, 1]) if variant == "norms" else x
            if variant == "fused":
                gu = y @ p["gate_up"]  # [1, 2 i]
                m = jax.nn.silu(gu[:, :i]) * gu[:, i:]
            else:
                m = jax.nn.silu(y @ p["gate"]) * (y @ p["up"])
            x = x + m @ p["down"]
        return x, jnp.argmax(x @ head, -1)  # [1, h], [1]

    return step


def time_variant(a, variant: str, dtype, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    layers, head, norms = make_weights(a, dtype, variant == "fused")
    nbytes = sum(w.nbytes for w in jax.tree.leaves((layers, head)))
    x = jnp.full((1, a.hidden), 0.01, dtype)
    step = step_fn(a, variant)
    t0 = time.perf_counter()
    compiled = step.lower(layers, head, norms, x).compile()
    compile_s = time.perf_counter() - t0
    y, _ = compiled(layers, head, norms, x)
    jax.block_until_ready(y)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        y, tok = compiled(layers, head, norms, x)
        jax.block_until_ready(tok)
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "best_s": min(times), "weight_bytes": nbytes,
            "compile_s": compile_s}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    import jax
    import jax.numpy as jnp

    from bastion_jax.latency import measure_copy_bandwidth

    dtype = jnp.dtype(a.dtype)
    bandwidth = measure_copy_bandwidth()
    rows = {}
    for variant in ("separate", "fused", "norms"):
        r = time_variant(a, variant, dtype, a.reps)
        r["floor_s"] = r["weight_bytes"] / bandwidth
        r["floor_over_step"] = r["floor_s"] / r["step_s"]
        rows[variant] = r
        print(f"{variant}: {r['step_s'] * 1e3:.3f} ms, floor {r['floor_s'] * 1e3:.3f} ms, "
              f"floor / step {r['floor_over_step']:.3f}, compile {r['compile_s']:.1f} s", file=sys.stderr)
    meta = {"name": a.name, "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "date": datetime.date.today().isoformat(), "commit": commit(), "dtype": a.dtype,
            "shapes": {k: getattr(a, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads",
                                                   "head_dim", "vocab")},
            "reps": a.reps, "copy_bandwidth": bandwidth, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    lines = [f"# {a.name}", "", f"{meta['device']}, {meta['date']}, commit {meta['commit']}, {a.dtype}, "
             f"{a.layers} layers of hidden {a.hidden} / intermediate {a.intermediate}, one decode row, "
             f"median of {a.reps}; copy bandwidth {bandwidth / 1e9:.1f} GB/s (measured); "
             f"XLA_FLAGS `{meta['xla_flags'] or '(none)'}`.", "",
             "| variant | products per layer | step ms | HBM floor ms | floor / step | compile s |", "|---|---|---|---|---|---|"]
    for variant, r in rows.items():
        lines.append(f"| {variant} | {4 if variant == 'fused' else 7} | {r['step_s'] * 1e3:.3f} | "
                     f"{r['floor_s'] * 1e3:.3f} | {r['floor_over_step']:.3f} | {r['compile_s']:.1f} |")
    write_results(a.out_dir, a.name, {"meta": meta, "variants": rows}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
