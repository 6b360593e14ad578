"""The committed-prefix read alone, per trip size: what `attention.prefix_chunk_default` was chosen from.

    python -m benchmarks.prefix_trips                                   # SmolLM2 shapes (30 layers)
    python -m benchmarks.prefix_trips --layers 2 --contexts 30 --queries 1 --trips 64 --reps 2   # smoke

Times `attention.prefix` (the XLA loop, every layer of a stacked [layers, 1, kv_heads, slots, d]
cache, one jitted call of `--layers` layers whose queries depend on the layer before) for each
number of queries (1: an AR step; 4, 16: tree steps), trip size and live context; prints medians in
ms as a markdown table. Only the prefix: whole steps move by less than a 2-core CPU's drift.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bastion_jax.modeling import attention


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--cache-len", type=int, default=1024)
    p.add_argument("--queries", type=_ints, default=[1, 4, 16])
    p.add_argument("--trips", type=_ints, default=[64, 128, 256], help="slots per trip of the loop")
    p.add_argument("--contexts", type=_ints, default=[30, 130, 300, 430, 700])
    p.add_argument("--reps", type=int, default=11)
    return p.parse_args(argv)


def prefix_stack(layers: int, kv: int, trip: int):
    """A jitted function: every layer's prefix partial, each layer's queries nudged by the last's output."""

    def run(q, k_cache, v_cache, length):
        out, total = q, jnp.float32(0)
        for i in range(layers):
            part = attention.prefix(attention.empty(out, kv), attention.group_queries(out, kv), k_cache, v_cache, length,
                                    trip, i)
            o = attention.finish(part, out.dtype)  # [b, t, q_heads * d]
            total = total + o.sum()
            out = q + o.reshape(q.shape) * 1e-3
        return total

    return jax.jit(run)


def main(argv=None) -> None:
    args = parse_args(argv)
    rng = np.random.default_rng(0)
    shape = (args.layers, 1, args.kv_heads, args.cache_len, args.head_dim)
    k_cache = jnp.asarray(rng.normal(size=shape), jnp.float32)
    v_cache = jnp.asarray(rng.normal(size=shape), jnp.float32)
    print(f"{jax.devices()[0].device_kind}, {args.layers} layers, kv {args.kv_heads} x {args.head_dim}, "
          f"{args.q_heads} query heads, cache {args.cache_len} slots; ms, median of {args.reps}\n")
    print("| queries | trip | " + " | ".join(f"context {c}" for c in args.contexts) + " |")
    print("|---|---|" + "---|" * len(args.contexts))
    for t in args.queries:
        q = jnp.asarray(rng.normal(size=(1, t, args.q_heads, args.head_dim)), jnp.float32)
        for trip in args.trips:
            fn = prefix_stack(args.layers, args.kv_heads, trip)
            row = []
            for c in args.contexts:
                length = jnp.asarray([c], jnp.int32)
                fn(q, k_cache, v_cache, length).block_until_ready()
                times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    fn(q, k_cache, v_cache, length).block_until_ready()
                    times.append(time.perf_counter() - t0)
                row.append(f"{1000 * np.median(times):.2f}")
            print(f"| {t} | {trip} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
