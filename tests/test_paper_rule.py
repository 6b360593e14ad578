"""`bastion-paper`: the official size rule applied to our best-first node list equals the official
heap builder with its stopping test (written here from spec D.2-D.4, independently of our code)."""

import heapq

import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.paper_rule import interpolated, paper_buckets, paper_tree_size
from bastion_jax.tree import build_tree


def official_size(log_probs: np.ndarray, k: int, verify_time, overhead: float, s_min: int, s_max: int) -> int:
    """Spec D.2-D.4: heap of candidates keyed by path log-prob (ties: earlier push first); pop, test,
    append, push first child then next sibling; fixed-interval rounding of the final size."""
    depth = log_probs.shape[0]
    order = np.argsort(-log_probs, axis=1, kind="stable")[:, :k]
    lam = np.take_along_axis(log_probs, order, axis=1)  # [D, K] sorted descending
    heap = [(-0.0, 0, 0, -1)]  # (-Lambda, push id, depth, rank)
    pushes, n, expected, cost, size_r = 1, 0, 0.0, None, s_min
    while heap:
        neg, _, t, rank = heapq.heappop(heap)
        p = float(np.exp(-neg))
        if n >= 1:
            nxt = verify_time(n + 1)
            if n >= s_min and p * (overhead + cost) <= expected * (nxt - cost):
                break
        n += 1
        expected += p
        if n >= size_r + s_min:
            size_r += s_min
        if n == s_max:
            break
        cost = verify_time(n)
        if t < depth:
            heapq.heappush(heap, (neg - lam[t, 0], pushes, t + 1, 0))
            pushes += 1
        if t > 0 and rank + 1 < k:
            heapq.heappush(heap, (neg + lam[t - 1, rank] - lam[t - 1, rank + 1], pushes, t, rank + 1))
            pushes += 1
    return size_r if size_r < n else n


@pytest.mark.parametrize("seed", range(12))
def test_rule_on_our_tree_equals_the_official_builder(seed):
    rng = np.random.default_rng(seed)
    depth, vocab, k = int(rng.integers(3, 8)), int(rng.integers(20, 60)), int(rng.integers(2, 6))
    sharp = rng.uniform(0.5, 4.0)
    logits = rng.normal(size=(depth, vocab)) * sharp
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    base, slope, quad = rng.uniform(5e-3, 2e-2), rng.uniform(1e-5, 3e-4), rng.uniform(0, 2e-6)
    verify_time = lambda n: base + slope * n + quad * n * n  # noqa: E731
    overhead = rng.uniform(1e-3, 1e-2)
    s_min, n_nodes = 8, 160
    want = official_size(log_probs.astype(np.float32), k, verify_time, overhead, s_min, n_nodes)
    tree = build_tree(jnp.int32(0), jnp.asarray(log_probs, jnp.float32), n_nodes, k)
    got = paper_tree_size(np.exp(np.asarray(tree.log_probs)), verify_time, overhead, s_min=s_min, s_max=n_nodes)
    assert got == want


def test_small_trees_rounding_and_buckets():
    flat = lambda n: 1.0 + 0.0 * n  # noqa: E731  verifying more is free: the tree takes everything
    probs = np.r_[1.0, np.full(70, 0.5), np.zeros(10)]
    assert paper_tree_size(probs, flat, 0.1, s_min=32) == 64  # 71 nodes, rounded down to 2 x 32
    assert paper_tree_size(probs[:20], flat, 0.1, s_min=32) == 20  # fewer than s_min: no rounding
    steep = lambda n: float(n)  # noqa: E731  every node costs a full step: stop as soon as allowed
    assert paper_tree_size(probs, steep, 0.1, s_min=32) == 32
    assert paper_buckets(100) == (32, 64, 96)
    with pytest.raises(ValueError, match="at least 32"):
        paper_buckets(16)
    f = interpolated((1, 4, 16), (1.0, 2.0, 5.0))
    assert f(4) == 2.0 and f(10) == pytest.approx(3.5) and f(20) == pytest.approx(6.0)


def test_paper_mode_is_lossless_and_picks_multiples_of_32(converted, monkeypatch):
    """Lossless, sizes in multiples of 32, and one read per step: the drafted tree's path probabilities
    come with its tokens (they were a second device->host read)."""
    from bastion_jax import tree_loop
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine, GenerationError
    from bastion_jax.testing import tiny_drafter_config

    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=6), seed=2)
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 8, 32, 64), top_k=8)
    prompts = [[5, 9, 11, 40, 41], [7, 3, 20]]
    ar = engine.generate(prompts, max_new_tokens=20, mode="ar").tokens
    reads, real_read = [], tree_loop.read
    monkeypatch.setattr(tree_loop, "read", lambda *a: reads.append(len(a)) or real_read(*a))
    res = engine.generate(prompts, max_new_tokens=20, mode="bastion-paper")
    monkeypatch.undo()
    assert res.tokens == ar
    assert reads == [4] * res.stats.steps  # tokens, counts, curve and the tree's log path probabilities
    assert set(res.stats.buckets) <= {32, 64} and sum(res.stats.buckets.values()) == res.stats.steps
    small = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 8, 16), top_k=8)
    with pytest.raises(GenerationError, match="at least 32"):
        small.generate(prompts, max_new_tokens=4, mode="bastion-paper")
