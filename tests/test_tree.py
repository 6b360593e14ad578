"""Device tree construction vs brute-force enumeration of the top-N prefixes."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.tree import build_tree, slice_tree, surrogate_curve


def brute_force(log_probs: np.ndarray, m: int, top_k: int) -> list[tuple[float, tuple[int, ...]]]:
    """All prefixes (token paths) whose tokens are in each depth's top-k, best m by path score."""
    depth, vocab = log_probs.shape
    allowed = [np.argsort(-log_probs[d])[:top_k] for d in range(depth)]
    paths = []
    for d in range(1, depth + 1):
        for toks in itertools.product(*allowed[:d]):
            paths.append((float(sum(log_probs[i, t] for i, t in enumerate(toks))), toks))
    paths.sort(key=lambda p: (-p[0], len(p[1])))
    return paths[:m]


def node_paths(tree) -> list[tuple[int, ...]]:
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    out = []
    for i in range(1, len(tokens)):
        path, j = [], i
        while j > 0:
            path.append(int(tokens[j]))
            j = int(parents[j])
        out.append(tuple(reversed(path)))
    return out


def random_lattice(rng, depth, vocab):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(depth, vocab)) * 2.0), axis=-1))


@pytest.mark.parametrize("seed", range(40))
def test_tree_equals_brute_force_top_n(seed):
    rng = np.random.default_rng(seed)
    depth, vocab = int(rng.integers(1, 5)), int(rng.integers(2, 6))
    top_k = int(rng.integers(1, vocab + 1))
    total = sum(top_k ** d for d in range(1, depth + 1))
    n = int(rng.integers(2, total + 3))  # sometimes more nodes than the lattice has
    lp = random_lattice(rng, depth, vocab)
    tree = jax.jit(build_tree, static_argnums=(2, 3))(jnp.int32(7), jnp.asarray(lp), n, top_k)
    ref = brute_force(lp, n - 1, top_k)
    valid = np.asarray(tree.tokens)[1:] >= 0
    assert valid.sum() == len(ref) == min(n - 1, total)
    assert node_paths(tree)[: len(ref)] == [p for _, p in ref]  # same nodes, same order
    np.testing.assert_allclose(np.asarray(tree.log_probs)[1:][valid], [s for s, _ in ref], rtol=1e-5, atol=1e-5)
    # Structure: root first, parents precede children, depths and the ancestor closure agree.
    parents, depths = np.asarray(tree.parents), np.asarray(tree.depths)
    assert parents[0] == -1 and int(tree.tokens[0]) == 7
    assert (parents[1:] < np.arange(1, n)).all()
    assert (depths[1:][valid] == depths[parents[1:][valid]] + 1).all()
    anc = np.asarray(tree.ancestors)
    for i in range(n):
        chain, j = {i}, i
        while parents[j] >= 0:
            j = parents[j]
            chain.add(j)
        assert set(np.flatnonzero(anc[i])) == chain


def test_every_prefix_is_a_tree_and_surrogate_is_path_probability_sum():
    rng = np.random.default_rng(0)
    lp = random_lattice(rng, 6, 20)
    tree = build_tree(jnp.int32(1), jnp.asarray(lp), 64, 8)
    buckets = (1, 2, 16, 32, 64)
    curve = np.asarray(surrogate_curve(tree, buckets))
    probs = np.exp(np.asarray(tree.log_probs))
    for b, a in zip(buckets, curve):
        sub = slice_tree(tree, b)
        assert (np.asarray(sub.parents)[1:] < np.arange(1, b)).all()
        np.testing.assert_allclose(a, probs[1:b].sum(), rtol=1e-5)
    assert curve[0] == 0.0
    # Path probabilities are non-increasing along the list (best-first order).
    assert (np.diff(np.asarray(tree.log_probs)[1:]) <= 1e-6).all()


def test_batched_with_vmap():
    rng = np.random.default_rng(1)
    lps = jnp.asarray(np.stack([random_lattice(rng, 3, 5) for _ in range(3)]))
    roots = jnp.array([1, 2, 3])
    batched = jax.vmap(build_tree, in_axes=(0, 0, None, None))(roots, lps, 10, 4)
    for i in range(3):
        single = build_tree(roots[i], lps[i], 10, 4)
        for a, b in zip(batched, single):
            np.testing.assert_array_equal(np.asarray(a)[i], np.asarray(b))


def test_tree_code_compiles_to_the_same_kernels_whatever_the_depth():
    """Tree build, ancestor mask and accept walk loop over the block's depths (scan / fori_loop), so
    a deeper block adds no kernels: XLA:GPU's compile time follows the kernel count (an unrolled
    depth loop made tree steps compile for minutes at 8B shapes on an H100)."""
    from benchmarks.compile_probe import count_kernels
    from bastion_jax.verify import walk

    def kernels(depth: int) -> int:
        lp = jax.ShapeDtypeStruct((2, depth, 64), jnp.float32)
        ints = jax.ShapeDtypeStruct((2, 16), jnp.int32)

        def step(lp, root, choices):
            tree = jax.vmap(build_tree, in_axes=(0, 0, None, None))(root, lp, 16, 4)
            return tree, jax.vmap(walk, in_axes=(0, 0, 0, None))(tree.tokens, tree.parents, choices, depth)

        return count_kernels(jax.jit(step).lower(lp, jax.ShapeDtypeStruct((2,), jnp.int32), ints).compile().as_text())

    assert kernels(4) == kernels(12) > 0


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_a_tree_reads_only_as_many_tokens_per_depth_as_it_has_nodes(n):
    """top_k past n - 1 changes nothing: a token ranked past n - 1 has n - 1 siblings ahead of it. The
    same tree and scores as the brute force over every token."""
    rng = np.random.default_rng(n)
    lp = random_lattice(rng, 3, 12)
    for top_k in (n - 1, 12):
        tree = build_tree(jnp.int32(7), jnp.asarray(lp), n, top_k)
        ref = brute_force(lp, n - 1, 12)
        assert node_paths(tree) == [p for _, p in ref]
        np.testing.assert_allclose(np.asarray(tree.log_probs)[1:], [s for s, _ in ref], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chain", [False, True])
def test_pair_candidates_hold_every_depths_top_m(chain):
    """One depth's best m children from the pruned (parent, rank) pairs equal those of all m x k pairs:
    parent scores sorted descending, each row's token scores sorted, and (with a chain) one parent at
    any rank scoring with unsorted numbers of its own, as `build_tree`'s scan body sees them."""
    from bastion_jax.tree import _pair_candidates

    rng = np.random.default_rng(0)
    for _ in range(300):
        m, k = int(rng.integers(1, 24)), int(rng.integers(1, 12))
        prev = -np.sort(rng.exponential(size=m)) * rng.uniform(0.1, 3)  # [m] descending
        off = -np.sort(rng.exponential(size=k)) * rng.uniform(0.1, 3)  # [k] descending
        scores = prev[:, None] + off[None, :]  # [m, k]
        if chain:
            r = int(rng.integers(0, m))
            scores[r] = prev[r] + rng.normal(size=k) * 2  # the chain's parent: its own, unsorted row
        want = set(np.argsort(-scores.reshape(-1), kind="stable")[:m].tolist())
        ci, cj = _pair_candidates(m, k, chain)
        cand = scores[ci, cj]
        if chain:  # the chain's row enters whole, as build_tree adds it
            keep = ci != r
            ci, cj, cand = (np.concatenate([ci[keep], np.full(k, r)]), np.concatenate([cj[keep], np.arange(k)]),
                            np.concatenate([cand[keep], scores[r]]))
        got = set((ci * k + cj)[np.argsort(-cand, kind="stable")[:m]].tolist())
        assert got == want, (m, k)
