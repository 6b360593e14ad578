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


def assert_tree_is(tree, want: list[tuple[float, tuple[int, ...]]]) -> None:
    """`tree`'s valid nodes are exactly the brute force's best paths `want` [(score, path)], in order."""
    valid = np.asarray(tree.tokens)[1:] >= 0
    assert valid.sum() == len(want)
    assert node_paths(tree)[: len(want)] == [tuple(int(t) for t in p) for _, p in want]
    np.testing.assert_allclose(np.asarray(tree.log_probs)[1:][valid], [s for s, _ in want], rtol=1e-5, atol=1e-5)


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


def per_parent_brute_force(root, shared, law, n_cond, m, top_k, ids=None, chain=None, first=0.0, cont=0.0):
    """Every path whose children come from the parent's own row (`law[d, parent]` for d in
    1..n_cond-1, or `law(d, path)` for a law of the whole path; the shared row `shared[d]` elsewhere;
    columns are token `ids`), each row's top-k plus
    the chain's token, scored by the two-state rule of `lookup` (see `test_lookup.two_state_brute_force`);
    the best m by (score desc, depth asc)."""
    depth, vocab = shared.shape
    ids = np.arange(vocab) if ids is None else np.asarray(ids)
    col_of = {int(t): c for c, t in enumerate(ids)}
    chain = [-1] * depth if chain is None else chain
    paths = []

    def rec(path, score, on, parent):
        d = len(path)
        if d == depth:
            return
        row = (law(d, path) if callable(law) else law[d, parent]) if 1 <= d < n_cond else shared[d]
        top = [int(ids[c]) for c in np.argsort(-row)[:top_k]]
        cands = top + ([chain[d]] if chain[d] >= 0 and chain[d] not in top else [])
        w = (first if d == 0 else cont) if chain[d] >= 0 else 0.0
        for t in cands:
            p = np.exp(row[col_of[t]]) if t in col_of else 0.0
            if on and w > 0:
                q = (1 - w) * (p if t in top or t == chain[d] else 0.0) + (w if t == chain[d] else 0.0)
                s = np.log(q) if q > 0 else -np.inf
            else:
                s = row[col_of[t]] if t in top else -np.inf
            if np.isfinite(s):
                paths.append((score + s, path + (t,)))
                rec(path + (t,), score + s, on and t == chain[d], t)

    rec((), 0.0, True, root)
    paths.sort(key=lambda x: (-x[0], len(x[1])))
    return paths[:m]


@pytest.mark.parametrize("seed", range(40))
def test_per_parent_tree_equals_brute_force(seed):
    """Children drawn from each parent's own law (a conditioned head) for depths 2..n_cond, with and
    without a lookup chain and a reduced vocabulary: the same nodes, order and scores as enumerating
    every path."""
    from bastion_jax.lookup import Chain

    rng = np.random.default_rng(500 + seed)
    depth, vocab = int(rng.integers(2, 5)), int(rng.integers(3, 6))
    top_k = int(rng.integers(1, vocab + 1))
    n_cond = int(rng.integers(0, depth + 1))
    shared = random_lattice(rng, depth, vocab)
    law = np.stack([random_lattice(rng, vocab, vocab) for _ in range(depth)])  # [depth, parent, vocab]
    ids = rng.permutation(vocab) if seed % 2 else None
    chain = first = cont = None
    if seed % 3 == 0:
        cut = int(rng.integers(1, depth + 1))
        chain = rng.integers(0, vocab, depth).tolist()[:cut] + [-1] * (depth - cut)
        first, cont = float(rng.uniform(0.1, 0.9)), float(rng.uniform(0.1, 0.9))
    root = int(rng.integers(0, vocab))
    compact = seed % 4 in (1, 2)  # the parents' laws over C of the columns only (a head on candidates)
    if compact:
        c_cols = int(rng.integers(1, vocab + 1))
        cols = np.stack([rng.permutation(vocab)[:c_cols] for _ in range(depth)])  # [depth, C]
        outside = np.ones((depth, vocab), bool)
        outside[np.arange(depth)[:, None], cols] = False
        law = np.where(outside[:, None, :], -np.inf, law)  # what the brute force sees: never drafted there
    ref = per_parent_brute_force(root, shared, law, n_cond, 400, top_k, ids, chain, first or 0.0, cont or 0.0)
    n = int(rng.integers(2, len(ref) + 3))
    c = None if chain is None else Chain(jnp.asarray(chain, jnp.int32), jnp.float32(first), jnp.float32(cont))
    law_j = jnp.asarray(law)
    if compact:
        cols_j = jnp.asarray(cols, jnp.int32)
        child_law = (lambda d, p, s: (law_j[d][p][:, cols_j[d]], cols_j[d], s))
    else:
        child_law = (lambda d, p, s: (law_j[d][p], None, s))
    tree = jax.jit(lambda r, lp, i, c: build_tree(r, lp, n, top_k, i, c, child_law, n_cond))(
        jnp.int32(root), jnp.asarray(shared), None if ids is None else jnp.asarray(ids, jnp.int32), c)
    assert_tree_is(tree, ref[: n - 1])


@pytest.mark.parametrize("seed", range(12))
def test_per_parent_laws_of_the_whole_path(seed):
    """A law that depends on every token above a node (a recurrent head): the state each parent hands
    its children (here a code of the path so far) reaches exactly that parent's children, so the tree
    equals enumerating every path with its own law."""
    rng = np.random.default_rng(900 + seed)
    depth, vocab = int(rng.integers(3, 5)), int(rng.integers(3, 5))
    top_k, n_cond = int(rng.integers(2, vocab + 1)), int(rng.integers(3, depth + 1))
    shared = random_lattice(rng, depth, vocab)
    codes = 1 + vocab ** (depth + 1)  # a path's code: its tokens in base vocab + 1, one row per code
    rows = np.stack([random_lattice(rng, codes, vocab) for _ in range(depth)])  # [depth, code, vocab]
    root = int(rng.integers(0, vocab))

    def code(path):
        c = root + 1
        for t in path:
            c = c * (vocab + 1) + t + 1
        return c % codes

    ref = per_parent_brute_force(root, shared, lambda d, path: rows[d, code(path)], n_cond, 400, top_k)
    n = int(rng.integers(2, len(ref) + 3))
    rows_j = jnp.asarray(rows)

    def child_law(d, parents, states):  # states [m, 1]: the code of each parent's parent's path
        own = (states[:, 0] * (vocab + 1) + parents + 1) % codes
        return rows_j[d][own], None, own[:, None]

    tree = jax.jit(lambda r, lp: build_tree(r, lp, n, top_k, None, None, child_law, n_cond,
                                            jnp.array([root + 1], jnp.int32)))(jnp.int32(root), jnp.asarray(shared))
    assert_tree_is(tree, ref[: n - 1])


def test_per_parent_tree_keeps_the_last_parents_peaked_child():
    """The pair bound is tight: with 3 nodes under the root, the second root child's only likely child
    (path -1.06) beats the first child's flat children (-1.61) and must be kept: pair (1, 0), 1 + 0 = m - 2."""
    shared = np.log(np.array([[0.6, 0.35, 0.05], [1 / 3, 1 / 3, 1 / 3]]))  # root children: 0, 1, 2
    law = np.log(np.full((2, 3, 3), 1 / 3))
    law[1, 1] = np.log([0.99, 0.005, 0.005])  # token 1's child 0 is near certain
    law_j = jnp.asarray(law)
    tree = build_tree(jnp.int32(2), jnp.asarray(shared), 4, 3, None, None, lambda d, p, s: (law_j[d][p], None, s), 2)
    assert node_paths(tree) == [(0,), (1,), (1, 0)]
    ref = per_parent_brute_force(2, shared, law, 2, 3, 3)
    assert [p for _, p in ref] == node_paths(tree)
