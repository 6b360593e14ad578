"""The default buckets: capped at 16 nodes on CPU, where the largest bucket prices every draft, and
why that changes no verified tree (a smaller tree is the first nodes of the larger one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.controller import CPU_BUCKETS, DEFAULT_BUCKETS, default_buckets
from bastion_jax.tree import build_tree

from test_tree import node_paths, random_lattice


def test_default_buckets_follow_the_backend():
    assert default_buckets() == (CPU_BUCKETS if jax.default_backend() == "cpu" else DEFAULT_BUCKETS)
    assert CPU_BUCKETS == tuple(b for b in DEFAULT_BUCKETS if b <= 16)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_smaller_tree_is_the_first_nodes_of_the_larger(seed):
    """Every bucket b <= 16 verifies the same nodes whether the tree was built for 16 or 64 nodes, so
    capping the buckets at 16 changes the draft's cost only, never what is verified."""
    rng = np.random.default_rng(seed)
    lp = jnp.asarray(random_lattice(rng, 15, 40))
    small, large = (build_tree(jnp.int32(3), lp, n, 128) for n in (16, 64))
    assert len(node_paths(small)) == 15 and node_paths(small) == node_paths(large)[:15]  # (the root's left out)
    np.testing.assert_array_equal(np.asarray(small.tokens), np.asarray(large.tokens)[:16])
    np.testing.assert_array_equal(np.asarray(small.parents), np.asarray(large.parents)[:16])


def test_an_engine_without_buckets_takes_the_default(converted):
    from bastion_jax.engine import Engine

    _, target = converted("qwen3")
    assert Engine(target, stop_ids=[-1]).buckets == default_buckets()
    assert Engine(target, stop_ids=[-1], buckets=(8, 1, 8)).buckets == (1, 8)
