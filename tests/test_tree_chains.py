"""Draft trees holding two lookup chains (the context's and the datastore's): checked against
enumerating every path under the law `tree._chain_rows` states, with and without per-parent laws
and a reduced vocabulary."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.lookup import Chain
from bastion_jax.tree import build_tree
from tests.test_tree import assert_tree_is, node_paths, random_lattice


def chain_law(t: int, p_t: float, drafted: bool, live: list[tuple[int, float]]) -> float:
    """P(child t) under a node on the live chains [(token, w)]: every set R of them that agrees on
    one token is the set of right chains with weight prod_R w prod_rest (1 - w); none right: the
    drafter's p (only for its drafted tokens and the live chains' tokens)."""
    mass, total = 0.0, 0.0
    for r in itertools.product((0, 1), repeat=len(live)):
        right = [tok for (tok, _), bit in zip(live, r) if bit]
        if len(set(right)) > 1:
            continue  # right chains that disagree: impossible
        weight = float(np.prod([w if bit else 1 - w for (_, w), bit in zip(live, r)]))
        total += weight
        if right:
            mass += weight * (t == right[0])
        else:
            mass += weight * (p_t if drafted or t in [tok for tok, _ in live] else 0.0)
    return mass / total


def chains_brute_force(root, shared, law, n_cond, m, top_k, ids, chains):
    """Every path, children of depth d from the parent's own row (`law[d, parent]`, d in 1..n_cond-1)
    or the shared row; candidates each row's top-k plus the tokens of the chains the parent is on;
    the best m by (score desc, depth asc). `chains`: [(tokens [depth], first, cont)]."""
    depth, vocab = shared.shape
    ids = np.arange(vocab) if ids is None else np.asarray(ids)
    col_of = {int(t): c for c, t in enumerate(ids)}
    paths = []

    def rec(path, score, on, parent):
        d = len(path)
        if d == depth:
            return
        row = law[d, parent] if 1 <= d < n_cond else shared[d]
        top = [int(ids[c]) for c in np.argsort(-row)[:top_k]]
        live = []
        for c in on:
            tokens, first, cont = chains[c]
            w = first if d == 0 else cont
            if tokens[d] >= 0 and w > 0:
                live.append((tokens[d], w))
        cands = list(dict.fromkeys(top + [tok for tok, _ in live]))
        for t in cands:
            p = float(np.exp(row[col_of[t]])) if t in col_of else 0.0
            if live:
                q = chain_law(t, p, t in top, live)
                s = np.log(q) if q > 0 else -np.inf
            else:
                s = row[col_of[t]] if t in top else -np.inf
            if np.isfinite(s):
                paths.append((score + s, path + (t,)))
                rec(path + (t,), score + s, [c for c in on if chains[c][0][d] == t], t)

    rec((), 0.0, list(range(len(chains))), root)
    paths.sort(key=lambda x: (-x[0], len(x[1])))
    return paths[:m]


def random_chains(rng, depth, vocab):
    """Two chains that often share a prefix (a joint state) and may end early or be missing."""
    a = rng.integers(0, vocab, depth).tolist()
    b = rng.integers(0, vocab, depth).tolist()
    shared = int(rng.integers(0, depth + 1))
    b[:shared] = a[:shared]
    out = []
    for tokens in (a, b):
        cut = int(rng.integers(0, depth + 1))  # 0: no chain at all
        tokens = tokens[:cut] + [-1] * (depth - cut)
        out.append((tokens, float(rng.uniform(0.1, 0.9)) if cut else 0.0, float(rng.uniform(0.1, 0.9)) if cut else 0.0))
    return out


def as_chain(chains) -> Chain:
    return Chain(jnp.asarray([c[0] for c in chains], jnp.int32), jnp.asarray([c[1] for c in chains], jnp.float32),
                 jnp.asarray([c[2] for c in chains], jnp.float32))


@pytest.mark.parametrize("seed", range(40))
def test_two_chain_tree_equals_brute_force(seed):
    """Shared rows, per-parent rows for depths 2..n_cond, a reduced vocabulary: the same nodes,
    order and scores as enumerating every path under the two-chain law."""
    rng = np.random.default_rng(2000 + seed)
    depth, vocab = int(rng.integers(2, 5)), int(rng.integers(3, 6))
    top_k = int(rng.integers(1, vocab + 1))
    n_cond = int(rng.integers(0, depth + 1)) if seed % 2 else 0
    shared = random_lattice(rng, depth, vocab)
    law = np.stack([random_lattice(rng, vocab, vocab) for _ in range(depth)])  # [depth, parent, vocab]
    ids = rng.permutation(vocab) if seed % 3 == 1 else None
    chains = random_chains(rng, depth, vocab)
    root = int(rng.integers(0, vocab))
    ref = chains_brute_force(root, shared, law, n_cond, 400, top_k, ids, chains)
    n = int(rng.integers(2, len(ref) + 3))
    law_j = jnp.asarray(law)
    tree = jax.jit(lambda r, lp, i, c: build_tree(r, lp, n, top_k, i, c, lambda d, p, s: (law_j[d][p], None, s),
                                                  n_cond))(
        jnp.int32(root), jnp.asarray(shared), None if ids is None else jnp.asarray(ids, jnp.int32), as_chain(chains))
    assert_tree_is(tree, ref[: n - 1])


def test_a_missing_second_chain_gives_the_one_chain_tree():
    """A second chain without tokens (no datastore match) leaves exactly the tree of the first alone."""
    rng = np.random.default_rng(7)
    lp = jnp.asarray(random_lattice(rng, 5, 9))
    one = Chain(jnp.asarray([3, 1, 4, 1, 5], jnp.int32), jnp.float32(0.6), jnp.float32(0.8))
    two = Chain(jnp.asarray([[3, 1, 4, 1, 5], [-1] * 5], jnp.int32), jnp.asarray([0.6, 0.0], jnp.float32),
                jnp.asarray([0.8, 0.0], jnp.float32))
    a, b = build_tree(jnp.int32(2), lp, 24, 3, None, one), build_tree(jnp.int32(2), lp, 24, 3, None, two)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


def test_both_chains_enter_the_tree_with_their_own_probabilities():
    """Two chains that differ from depth 1 on: both are paths of the tree (the drafter ranks neither
    token), each first token scored w_c (1 - w_other) / (1 - w1 w2) plus the drafter's share."""
    lp = np.log(np.full((3, 6), 1 / 6))
    a, b = [4, 5, 0], [1, 2, 3]
    two = Chain(jnp.asarray([a, b], jnp.int32), jnp.asarray([0.7, 0.5], jnp.float32), jnp.asarray([0.9, 0.9], jnp.float32))
    tree = build_tree(jnp.int32(0), jnp.asarray(lp, jnp.float32), 10, 1, None, two)
    paths = node_paths(tree)
    assert tuple(a) in paths and tuple(b) in paths
    z = 1 - 0.7 * 0.5
    got = dict(zip(paths, np.exp(np.asarray(tree.log_probs)[1:])))
    assert got[(4,)] == pytest.approx((0.7 * 0.5 + 0.15 / 6) / z, rel=1e-5)
    assert got[(1,)] == pytest.approx((0.5 * 0.3 + 0.15 / 6) / z, rel=1e-5)


def test_an_off_chain_parent_below_both_chain_nodes_keeps_all_its_children():
    """The pair bound with two chains: the two chain nodes of depth 1 outrank the drafter's node, whose
    flat children then fill ten of the fifteen nodes (ranks 0..9); its rows above it are both
    unsorted chain rows, so a bound of one chain's (rank <= 6 here) would lose three of them."""
    d1 = np.full(16, 0.02 / 13)
    d1[[0, 1, 2]] = [0.01, 0.01, 0.96]
    d2 = 1.0 - 0.01 * np.arange(16)
    lp = np.log(np.stack([d1 / d1.sum(), d2 / d2.sum()]))
    chains = [([0, 5], 0.6, 0.99), ([1, 6], 0.5, 0.99)]
    tree = build_tree(jnp.int32(3), jnp.asarray(lp, jnp.float32), 16, 16, None, as_chain(chains))
    ref = chains_brute_force(3, lp, None, 0, 15, 16, None, chains)
    assert sum(len(p) == 2 and p[0] == 2 for _, p in ref) == 10
    assert node_paths(tree) == [p for _, p in ref]
