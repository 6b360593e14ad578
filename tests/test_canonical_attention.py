"""`attend_canonical` and `ordered_mean`: the bf16-on-CPU forms that make a token's logits the same,
bits included, whether an AR step or a verify step computed it.

Two properties: the attention is the attention (against the dense brute-force reference of
`test_attention.py`, any tree, chunk boundaries crossed, batch rows at other lengths), and a tree
node's output equals, bit for bit, a one-query step at the node's position whose cache holds the
prefix and the node's ancestors in order (what AR would have). The second fails with `attend_split`,
which folds the new keys apart from the cache (its outputs differ in the last bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.modeling.attention import attend, attend_canonical
from bastion_jax.modeling.cache import causal_mask, write_rows
from bastion_jax.modeling.layers import ordered_mean
from bastion_jax.tree import ancestor_mask

from test_attention import dense_mask, heads_first, random_tree_parents


def tree_masks(rng, rows: int, n: int) -> np.ndarray:
    """[rows, n, n] ancestor masks (self included) of random trees whose parents precede children."""
    return np.stack([np.asarray(ancestor_mask(jnp.asarray(random_tree_parents(rng, n)), n)) for _ in range(rows)])


@pytest.mark.parametrize("max_len,chunk", [(40, 8), (56, 16), (37, 7)])
def test_canonical_attention_matches_dense(max_len, chunk):
    """Trees and a chain against one dense softmax over the cache with the new keys written in; rows at
    lengths inside a chunk, on a boundary and where the tree crosses one (37: not a whole number of
    chunks, the boundary chunk read clamped); one layer of stacked caches read in place alike."""
    rng = np.random.default_rng(max_len + chunk)
    b, n, hq, hkv, d = 4, 9, 4, 2, 8
    lengths = np.array([0, 5, 2 * chunk, 3 * chunk - 3])  # (+ n <= max_len: the tree fits)
    for new_mask in (tree_masks(rng, b, n), np.asarray(causal_mask(b, n))):
        q = jnp.asarray(rng.normal(size=(b, n, hq, d)), jnp.float32)
        k_cache = jnp.asarray(rng.normal(size=(b, max_len, hkv, d)) * 3, jnp.float32)  # garbage past the length
        v_cache = jnp.asarray(rng.normal(size=(b, max_len, hkv, d)), jnp.float32)
        k_new = jnp.asarray(rng.normal(size=(b, n, hkv, d)) * 3, jnp.float32)
        v_new = jnp.asarray(rng.normal(size=(b, n, hkv, d)), jnp.float32)
        length = jnp.asarray(lengths, jnp.int32)
        got = attend_canonical(q, *heads_first(k_cache, v_cache), length, k_new, v_new, jnp.asarray(new_mask),
                               chunk=chunk)
        want = attend(q, write_rows(k_cache, k_new, length), write_rows(v_cache, v_new, length),
                      jnp.asarray(dense_mask(lengths, new_mask, max_len)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
        stacked = [jnp.stack([-c, c, c * 0 + 5]) for c in heads_first(k_cache, v_cache)]
        in_place = jax.jit(lambda i: attend_canonical(q, *stacked, length, k_new, v_new, jnp.asarray(new_mask),
                                                      layer=i, chunk=chunk))(jnp.int32(1))
        np.testing.assert_allclose(np.asarray(in_place), np.asarray(got), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("length", [3, 14, 16, 21, 30])  # the tree inside one chunk of 8, or across
def test_a_tree_node_attends_bit_for_bit_as_an_ar_step_would(length):
    """bf16: each node of a verified tree against a one-query step at its position over a cache that
    holds the prefix, then its ancestors by depth (the cache AR would have built), itself the new key."""
    rng = np.random.default_rng(length)
    n, hq, hkv, d, max_len, chunk = 12, 4, 2, 16, 64, 8
    parents = random_tree_parents(rng, n)
    mask = np.asarray(ancestor_mask(jnp.asarray(parents), n))  # [n, n]
    bf = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)  # noqa: E731
    q, k_new, v_new = bf(1, n, hq, d), bf(1, n, hkv, d), bf(1, n, hkv, d)
    k_cache, v_cache = bf(1, hkv, max_len, d), bf(1, hkv, max_len, d)
    step = jax.jit(lambda q, kc, vc, ln, k, v, m: attend_canonical(q, kc, vc, ln, k, v, m, chunk=chunk))
    tree = np.asarray(step(q, k_cache, v_cache, jnp.asarray([length]), k_new, v_new, jnp.asarray(mask[None])))
    for i in range(n):
        path = np.flatnonzero(mask[i])  # its ancestors in node order = by depth, then itself
        depth = len(path) - 1
        slots = length + np.arange(depth)
        kc = k_cache.at[:, :, slots].set(k_new[0, path[:-1]].swapaxes(0, 1)[None])
        vc = v_cache.at[:, :, slots].set(v_new[0, path[:-1]].swapaxes(0, 1)[None])
        ar = step(q[:, i:i + 1], kc, vc, jnp.asarray([length + depth]), k_new[:, i:i + 1], v_new[:, i:i + 1],
                  jnp.ones((1, 1, 1), bool))
        np.testing.assert_array_equal(np.asarray(ar)[0, 0], tree[0, i], err_msg=f"node {i} (depth {depth})")


def test_ordered_mean_is_the_mean_whatever_rows_share_it():
    """Close to jnp.mean, and a row's value does not depend on the other rows (a reduce's does)."""
    rng = np.random.default_rng(0)
    f = jax.jit(ordered_mean)
    for h in (576, 64, 100):  # a multiple of the lanes, and not
        x = jnp.asarray(rng.normal(size=(16, h)) ** 2, jnp.float32)
        np.testing.assert_allclose(np.asarray(f(x)), np.asarray(jnp.mean(x, -1, keepdims=True)), rtol=1e-6)
        alone = [np.asarray(f(x[i:i + 1])) for i in range(16)]
        for rows in (2, 5, 16):
            np.testing.assert_array_equal(np.asarray(f(x[:rows])), np.concatenate(alone[:rows]))
