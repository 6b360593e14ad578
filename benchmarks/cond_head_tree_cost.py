"""CPU cost of building a drafting call's trees with per-parent laws (`--cond-depths`) against the spine's, at
SmolLM2 shapes (hidden 576, 8,192-token draft vocabulary, rank-64 head, random weights): what the
auto default of `Engine(cond_depths=None)` rests on. `python -m benchmarks.cond_head_tree_cost [--reps N]`."""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cond_head_tree_cost", description=__doc__)
    p.add_argument("--reps", type=int, default=20, help="timed builds per setting (median printed)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bastion_jax.modeling.cond_head import CondHead, HeadTables, embed_table, head_law
    from bastion_jax.tree_decoding import draft_trees

    h, N, D, V, r = 576, 8192, 15, 49152, 64  # hidden, draft vocabulary, block slots, vocabulary, head rank
    E = jax.random.normal(jax.random.key(0), (V, h)) * 0.02  # [V, h] embedding table
    ids = jnp.arange(N, dtype=jnp.int32)
    head = CondHead(h, r, rngs=nnx.Rngs(0))
    hid = jax.random.normal(jax.random.key(2), (1, D, h))  # [b, D, h] drafter hidden states
    base = jax.random.normal(jax.random.key(3), (1, D, N)) * 3  # [b, D, N] head-free logits
    table = jax.random.normal(jax.random.key(1), (N, r)) * 0.01  # [N, rank]
    law = head_law(head, hid, base, HeadTables(table, embed_table(head, E)))
    root = jnp.array([5])
    for buckets in ((1, 4, 8, 16), (1, 4, 8, 16, 32, 64)):
        for cd in (0, 2, 3, 4, 5):
            def build():
                return draft_trees(buckets, 128, cd, root, base, ids, None, law if cd else None)
            jax.block_until_ready(build())
            ts = []
            for _ in range(args.reps):
                t = time.perf_counter()
                jax.block_until_ready(build())
                ts.append(time.perf_counter() - t)
            print(f"max bucket {max(buckets)} cond_depths {cd}: {np.median(ts) * 1e3:.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
