"""The official BASTION tree-size rule (`--mode bastion-paper`), for comparison with our controller.

The official builder pops candidates best-first and stops, once the tree holds at least `s_min`
nodes, at the first candidate x whose path probability p_x no longer raises the expected tokens per
unit time (spec D.3):

    stop  <=>  n >= s_min  and  p_x * (T_draft + T_nv + C(n))  <=  E_n * (C(n+1) - C(n))

with E_n the sum of the n tree nodes' path probabilities (root included, p = 1) and C(n) the
calibrated verify time of n tokens. The size is then rounded down to a multiple of `step` (= s_min,
"fixed_interval", spec D.4). Our trees list nodes in the same best-first order, so the rule is a
scan over the node list's path probabilities; the only difference is that sizes are capped at the
largest compiled bucket (the official cap is 8192) and the paper policy always drafts.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

S_MIN = 32  # _MIN_ADAPTIVE_BEST_TREE_NODES, also the bucket step


def paper_tree_size(path_probs: np.ndarray, verify_time: Callable[[int], float], overhead: float,
                    s_min: int = S_MIN, s_max: int | None = None) -> int:
    """Tree size the official rule picks for one tree.

    path_probs: [N] path probabilities in best-first node order, node 0 the root (1.0); padding
    nodes (0 or non-finite) end the list. verify_time(n): seconds to verify n tokens at this context.
    overhead: T_draft + T_nv, the per-step cost that does not grow with the tree."""
    probs = np.asarray(path_probs, np.float64)
    limit = len(probs) if s_max is None else min(s_max, len(probs))
    n, expected, cost = 1, 1.0, verify_time(1)
    while n < limit:
        p = probs[n]
        if not np.isfinite(p) or p <= 0:
            break  # the lattice ran out of candidates (the official heap empties)
        nxt = verify_time(n + 1)
        if n >= s_min and p * (overhead + cost) <= expected * (nxt - cost):
            break
        expected, cost, n = expected + p, nxt, n + 1
    return (n // s_min) * s_min if n >= s_min else n


def paper_buckets(max_bucket: int, s_min: int = S_MIN) -> tuple[int, ...]:
    """The sizes the paper policy can pick with our static shapes: s_min, 2 s_min, ... <= max_bucket."""
    if max_bucket < s_min:
        raise ValueError(f"bastion-paper needs a bucket of at least {s_min} nodes (largest is {max_bucket})")
    return tuple(range(s_min, max_bucket + 1, s_min))


def interpolated(buckets: Sequence[int], times: Sequence[float]) -> Callable[[int], float]:
    """verify_time(n) through the calibrated bucket times: linear between buckets, and through the
    origin's slope below the smallest / the last segment's slope above the largest."""
    xs = np.asarray(buckets, np.float64)
    ys = np.asarray(times, np.float64)

    def f(n: int) -> float:
        if len(xs) == 1:
            return float(ys[0] * n / xs[0])
        if n <= xs[0]:
            return float(max(ys[0] * n / xs[0], 0.0))
        if n >= xs[-1]:
            return float(ys[-1] + (n - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return float(np.interp(n, xs, ys))

    return f
