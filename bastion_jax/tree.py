"""Best-first draft trees built on device with static shapes (pure jnp, jittable, vmappable).

The drafter's marginals are position-wise, so every depth-d node has the same K candidate children
(the top-K tokens of block position d) and a path's score is the sum of its tokens' log-probs.
The N best prefixes are found without a heap: keep the N best nodes at depth 1; at each further
depth take the top N of (kept parents) x (K tokens); then the global top N over all depths, by
score descending and depth ascending. A node of the global top N always has its parent in the
previous depth's top N (a child never outscores its parent and ties go to the shallower node), so
this equals the best-first heap of BASTION's builder, and that order puts parents before
children: every prefix of the node list is a valid tree, for every bucket.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from bastion_jax.lookup import Chain


# child_law(d, parent tokens [m], states [m, S]) -> (log-probs [m, C], columns [C] or None, states
# [m, S]): row d's law given each parent and the state its own parent handed down, over C of the
# vocabulary's columns (None: all of them, C = vocab; else which ones, the rest never drafted there),
# and the state it hands its children (`build_tree`)
ChildLaw = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array | None, jax.Array]]


class Tree(NamedTuple):
    """A draft tree of `n` nodes, node 0 the root; per-row arrays (add a leading batch axis)."""

    tokens: jax.Array  # [n] int32; padding nodes hold -1 and can never match a target choice
    parents: jax.Array  # [n] int32; -1 for the root, padding nodes point at the root
    depths: jax.Array  # [n] int32; root 0
    log_probs: jax.Array  # [n] f32 path log-probability; root 0, padding -inf
    ancestors: jax.Array  # [n, n] bool; [i, j] = node j is node i or an ancestor of i


def build_tree(root: jax.Array, log_probs: jax.Array, num_nodes: int, top_k: int, ids: jax.Array | None = None,
               chain: Chain | None = None, child_law: ChildLaw | None = None, cond_depths: int = 0,
               child_state: jax.Array | None = None) -> Tree:
    """Top `num_nodes - 1` prefixes of the lattice `log_probs` [depth, vocab] under `root`.

    `log_probs` row d-1 is the drafter's log-distribution for depth d (block slot d); `ids` [vocab]
    maps its columns to token ids (a reduced draft vocabulary; default: the column is the id).
    `chain` (a context-lookup chain, see `lookup.py`) adds its token at each depth as a candidate and
    scores paths in two states: on the chain (every token so far equals the chain's), a child equal
    to the chain's next token has probability w + (1 - w) p and any other child (1 - w) p, with
    w = chain.first at depth 1 and chain.cont deeper (p the drafter's, for the chain's token whatever
    its rank); off the chain the drafter's p alone.

    Only the top min(top_k, num_nodes - 1) tokens per depth are read: a token ranked lower has at least
    num_nodes - 1 siblings ahead of it (same parent, no lower score, and ties go to the better rank), so
    it is never one of the tree's num_nodes - 1 nodes. Same tree, a smaller top-k and candidate lists.

    `child_law` (with `cond_depths` >= 2): the children of depths 2..cond_depths come from each
    parent's own law, `child_law(d, parent tokens [m], states [m, S])` -> (log-probs [m, C], columns
    [C] or None, states [m, S]) for row d (a drafter's conditioned head, `modeling/cond_head.py`;
    C < vocab: the law's candidate columns, the only children drafted there), instead of the
    depth's shared row. The states are what each parent's own parent handed down (`child_state` [S]
    for the root's children; none when None) and what the parent hands its children: a law that
    depends on the whole path above it (a recurrent head) stays exact per node. Depth 1
    (the root's children) and deeper depths keep `log_probs`. Each depth still keeps its best m
    (parent, child) pairs: a pair (i, j), parent i of the kept list and its child of rank j in that
    parent's own sorted row, has parents 0..i and i's j better children ahead of it, so it can be
    among the tree's m nodes only when i + j <= m - 2 (`_cond_pairs`).
    """
    depth, vocab = log_probs.shape
    m = num_nodes - 1  # non-root nodes
    if m == 0:  # a one-node tree (buckets (1,)): the root alone, verified as an AR step would be
        parents = jnp.full((1,), -1, jnp.int32)
        return Tree(root[None].astype(jnp.int32), parents, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.float32),
                    ancestor_mask(parents, depth))
    k = min(top_k, vocab, m)
    # The barrier keeps XLA:CPU from rewriting top-k + the gathers below into a full sort of the
    # vocabulary (195 ms -> 3 ms per tree at SmolLM2's 49k vocab); GPU is unaffected.
    top_lp, top_tok = jax.lax.optimization_barrier(jax.lax.top_k(log_probs.astype(jnp.float32), k))  # [depth, k]
    if ids is not None:
        top_tok = ids[top_tok]
    neg_inf = jnp.float32(-jnp.inf)
    if chain is None:
        on_lp = off_lp = top_lp
    else:
        look = chain.tokens  # [depth] target ids
        if ids is None:
            chain_col = jnp.clip(look, 0, vocab - 1)
        else:  # the chain token's column in the draft vocabulary, if it has one (else -inf below)
            chain_col = jnp.argmax(ids[None, :] == look[:, None], axis=1)
            look_ok = jnp.any(ids[None, :] == look[:, None], axis=1)
        chain_lp = jnp.take_along_axis(log_probs, chain_col[:, None], axis=1)[:, 0].astype(jnp.float32)
        if ids is not None:
            chain_lp = jnp.where(look_ok, chain_lp, neg_inf)
        chain_lp = jnp.where(look >= 0, chain_lp, neg_inf)  # [depth]
        w = jnp.where(jnp.arange(depth) == 0, chain.first, chain.cont)  # [depth]
        top_lp, top_tok, on_lp = _candidates_with_chain(top_lp, top_tok, look, w, chain_lp)
        off_lp = top_lp
        k = k + 1

    def keep_best(scores: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Top m of a flat candidate list, padded with -inf when there are fewer than m."""
        if scores.shape[0] < m:
            scores = jnp.concatenate([scores, jnp.full((m - scores.shape[0],), neg_inf)])
        return jax.lax.top_k(scores, m)

    # Depth 1: children of the root (on the chain, if there is one).
    s, idx = keep_best(on_lp[0])  # [m]
    tok = jnp.where(idx < k, top_tok[0][jnp.minimum(idx, k - 1)], -1)
    chain_tok = chain.tokens if chain is not None else jnp.full((depth,), -1, jnp.int32)  # [depth]
    on = (tok >= 0) & (tok == chain_tok[0])  # [m] still on the chain

    def expand(prev, on, pairs, on_rows, off_rows, tok_rows, chain_d):
        """The top m of (kept parents) x (their candidates) among `pairs` (parent, rank), each parent's
        row given by `*_rows(parent, rank)`. With a chain, at most one kept node is on it: its row
        (the on-chain scores, unsorted) goes in whole, last. Returns (scores, on, parent, token) [m]."""
        ci, cj = pairs
        if chain is None:
            s, idx = keep_best(prev[ci] + off_rows(ci, cj))  # [m] of the candidate pairs, in flat order
            parent, rank = ci[idx], cj[idx]
        else:
            r = jnp.argmax(on)
            has = on[r]
            off = jnp.where(has & (ci == r), neg_inf, prev[ci] + off_rows(ci, cj))  # [n_pairs]
            on_row = jnp.where(has, prev[r] + on_rows(r), neg_inf)  # [k]
            s, idx = keep_best(jnp.concatenate([off, on_row]))
            n_off = ci.shape[0]
            pair = jnp.minimum(idx, n_off - 1)  # (read only where idx < n_off: an off-chain pair)
            parent = jnp.where(idx < n_off, ci[pair], r)
            rank = jnp.where(idx < n_off, cj[pair], idx - n_off)
        tok = tok_rows(parent, rank)
        on = on[parent] & (tok == chain_d) if chain is not None else on
        return s, on, parent.astype(jnp.int32), tok

    shared_pairs = tuple(map(jnp.asarray, _pair_candidates(m, k, chain is not None)))  # [n_pairs] each

    def deeper(carry, xs):
        """One more depth from its shared candidate row: the top m of (kept parents) x (k tokens). A
        scan, not a Python loop: one body to compile whatever the block size (XLA:GPU's compile time
        follows the kernel count)."""
        prev, on, _ = carry  # [m] scores, [m] bool, [m] tokens
        on_d, off_d, tok_d, chain_d = xs  # [k], [k], [k], []
        s, on, parent, tok = expand(prev, on, shared_pairs, lambda r: on_d, lambda i, j: off_d[j],
                                    lambda i, j: tok_d[j], chain_d)
        return (s, on, tok), (s, parent, tok)

    n_cond = min(cond_depths, depth) if child_law is not None else 0  # depths 2..n_cond: per-parent laws
    carry = (s, on, tok)
    levels = [(s[None], jnp.full((1, m), -1, jnp.int32), tok[None])]
    if n_cond >= 2:
        state0 = jnp.zeros((0,), jnp.float32) if child_state is None else child_state
        carry, level = _conditioned_depths(child_law, carry, jnp.broadcast_to(state0, (m,) + state0.shape), n_cond,
                                           m, k, ids, chain, expand)
        levels.append(level)
    start = max(n_cond, 1)
    if start < depth:
        _, level = jax.lax.scan(deeper, carry, (on_lp[start:], off_lp[start:], top_tok[start:], chain_tok[start:]))
        levels.append(level)  # each [depth - start, m]
    level_scores, level_parent, level_tok = (list(x) for x in zip(*levels))

    scores = jnp.concatenate(level_scores).reshape(-1)  # [depth * m], candidate c = (d-1) * m + local
    cand_depth = jnp.repeat(jnp.arange(1, depth + 1, dtype=jnp.int32), m)
    # Global order: score descending, then depth ascending (parents before children on ties).
    order = jax.lax.sort((-scores, cand_depth, jnp.arange(depth * m, dtype=jnp.int32)), num_keys=2,
                         is_stable=True)[2][:m]
    node_of = jnp.zeros((depth * m,), jnp.int32).at[order].set(jnp.arange(1, m + 1, dtype=jnp.int32))

    sel_scores = scores[order]
    sel_depth = cand_depth[order]
    local_parent = jnp.concatenate(level_parent).reshape(-1)[order]  # index within the previous depth's list
    parent_cand = (sel_depth - 2) * m + local_parent
    parents = jnp.where(sel_depth == 1, 0, node_of[jnp.clip(parent_cand, 0, depth * m - 1)])
    valid = jnp.isfinite(sel_scores)
    tokens = jnp.where(valid, jnp.concatenate(level_tok).reshape(-1)[order], -1)
    parents = jnp.where(valid, parents, 0)

    tree_tokens = jnp.concatenate([root[None].astype(jnp.int32), tokens.astype(jnp.int32)])
    tree_parents = jnp.concatenate([jnp.array([-1], jnp.int32), parents.astype(jnp.int32)])
    tree_depths = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.where(valid, sel_depth, 0)])
    tree_lp = jnp.concatenate([jnp.zeros((1,), jnp.float32), sel_scores])
    return Tree(tree_tokens, tree_parents, tree_depths, tree_lp, ancestor_mask(tree_parents, depth))


def _pair_candidates(m: int, k: int, chain: bool) -> tuple[np.ndarray, np.ndarray]:
    """The (parent, rank) pairs of one depth, in flat order, that can be among its best m children.

    Why: the kept parents' scores are sorted (descending) and so is each depth's token list, so pair
    (i, j) is outscored, or tied at a lower flat index, by every (i', j') with i' <= i, j' <= j: with
    (i + 1)(j + 1) > m of them it is never kept. At k = m = 63 that leaves 273 of 3,969 pairs (a 64-node
    tree over 8,192 columns on CPU: 1.57 -> 1.41 ms). With a lookup chain, the one parent on the chain
    scores with other (unsorted) numbers: its row is taken whole, after the others (so an exact tie
    between an on-chain and an off-chain pair keeps the off-chain one), and an off-chain row i >= 1
    has at least i sorted rows at or above it, so (i, j) needs i (j + 1) <= m (335 pairs)."""
    i, j = np.meshgrid(np.arange(m), np.arange(k), indexing="ij")
    rows_above = np.maximum(i, 1) if chain else i + 1
    keep = (rows_above * (j + 1) <= m).reshape(-1)
    return i.reshape(-1)[keep].astype(np.int32), j.reshape(-1)[keep].astype(np.int32)


def _cond_pairs(m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The (parent, rank) pairs of a depth whose parents each have their own sorted row that can be
    among the tree's m nodes: pair (i, j) has the kept parents 0..i (no lower score, shallower) and
    parent i's j better children ahead of it, so it needs i + 1 + j <= m - 1 (the pair (0, 0) always)."""
    i, j = np.meshgrid(np.arange(m), np.arange(k), indexing="ij")
    keep = (i + j <= max(m - 2, 0)).reshape(-1)
    return i.reshape(-1)[keep].astype(np.int32), j.reshape(-1)[keep].astype(np.int32)


def _conditioned_depths(child_law: ChildLaw, carry, states: jax.Array, n_cond: int, m: int, k: int,
                        ids: jax.Array | None, chain: Chain | None, expand):
    """Depths 2..n_cond of `build_tree`, each kept parent's children from its own law: a scan over
    the depths whose body asks `child_law` for the m kept parents' rows (given the states [m, S]
    their parents handed down), takes each row's top k (and, with a chain, the chain token's log-prob
    in each row) and keeps the best m pairs, each child with its parent's state."""
    neg_inf = jnp.float32(-jnp.inf)
    kk = k - (chain is not None)  # the drafter's candidates per row (a chain adds its token as one more)

    def body(carry, d):
        prev, on, ptok, pstate = carry  # [m] scores, [m] bool, [m] target ids (-1: padding), [m, S]
        law, cols, state = child_law(d, jnp.maximum(ptok, 0), pstate)  # [m, C], [C] or None, [m, S]
        law = law.astype(jnp.float32)
        width = min(kk, law.shape[1])  # a law over C < kk candidate columns offers C children
        pairs = tuple(map(jnp.asarray, _cond_pairs(m, width)))
        lp, col = jax.lax.optimization_barrier(jax.lax.top_k(law, width))  # [m, width] (barrier: see build_tree)
        ids_c = ids if cols is None else (cols if ids is None else ids[cols])  # a column's token id (None: itself)
        tok = ids_c[col] if ids_c is not None else col
        if chain is None:
            on_rows = off_rows = lp
            chain_d = jnp.int32(-1)
        else:
            chain_d = chain.tokens[d]
            hit = (ids_c == chain_d) if ids_c is not None else (jnp.arange(law.shape[1]) == chain_d)  # [C]
            chain_lp = jnp.where((chain_d >= 0) & hit.any(), jnp.max(jnp.where(hit[None], law, neg_inf), axis=1),
                                 neg_inf)  # [m]
            off_rows, tok, on_rows = _candidates_with_chain(lp, tok, jnp.full((m,), chain_d), jnp.full((m,), chain.cont),
                                                            chain_lp)
        s, on, parent, new_tok = expand(prev, on, pairs, lambda r: on_rows[r], lambda i, j: off_rows[i, j],
                                        lambda i, j: tok[i, j], chain_d)
        return (s, on, new_tok, state[parent]), (s, parent, new_tok)

    (s, on, tok, _), level = jax.lax.scan(body, carry + (states,), jnp.arange(1, n_cond))
    return (s, on, tok), level


def _candidates_with_chain(top_lp: jax.Array, top_tok: jax.Array, look: jax.Array, w: jax.Array, chain_lp: jax.Array
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The candidate rows [rows, k + 1] with the chain's token added as a last column (-inf off the
    chain; -inf both ways when it is already a candidate or there is none), and their on-chain
    log-probs. Per row (a depth, or a parent of one depth): `look` the chain's token (-1: none), `w`
    the chain's weight there, `chain_lp` the drafter's log-prob of the chain's token (-inf: none)."""
    look = look[:, None]  # [rows, 1]
    w = jnp.where(look >= 0, w[:, None], 0.0)  # [rows, 1]
    is_look = (top_tok == look) & (look >= 0)  # [rows, k]
    extra = (look >= 0) & ~is_look.any(axis=1, keepdims=True)  # the chain's token is not a candidate
    mixed = jnp.log((1.0 - w) * jnp.exp(top_lp) + jnp.where(is_look, w, 0.0))  # [rows, k]
    on_lp = jnp.where(w > 0, mixed, top_lp)  # past the chain's end the drafter's own numbers, exactly
    neg_inf = jnp.float32(-jnp.inf)
    top_tok = jnp.concatenate([top_tok, jnp.where(extra, look, -1)], axis=1)  # [rows, k + 1]
    top_lp = jnp.concatenate([top_lp, jnp.full((top_lp.shape[0], 1), neg_inf)], axis=1)
    extra_lp = jnp.log(w + (1.0 - w) * jnp.exp(chain_lp)[:, None])  # [rows, 1] w + (1 - w) p
    on_lp = jnp.concatenate([on_lp, jnp.where(extra & (w > 0), extra_lp, neg_inf)], axis=1)  # w = 0: no chain
    return top_lp, top_tok, on_lp


def ancestor_mask(parents: jax.Array, max_depth: int) -> jax.Array:
    """[n, n] bool closure of the parent relation (self included): `max_depth` hops towards the root."""
    n = parents.shape[0]
    hop = jnp.where(parents < 0, jnp.arange(n), parents)  # root points at itself

    def up(_, carry):  # one hop for every node at once (a loop: one body to compile)
        anc, cur = carry
        cur = hop[cur]
        return anc.at[jnp.arange(n), cur].set(True), cur

    return jax.lax.fori_loop(0, max_depth, up, (jnp.eye(n, dtype=bool), jnp.arange(n)))[0]


def surrogate_curve(tree: Tree, buckets: tuple[int, ...]) -> jax.Array:
    """Expected accepted draft tokens A(b) = sum of path probabilities of nodes 1..b-1, per bucket."""
    cum = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(jnp.exp(tree.log_probs[1:]))])  # [n]
    return cum[jnp.asarray([b - 1 for b in buckets])]


def slice_tree(tree: Tree, n: int) -> Tree:
    """The first `n` nodes (a valid tree, since parents precede children)."""
    return Tree(tree.tokens[..., :n], tree.parents[..., :n], tree.depths[..., :n], tree.log_probs[..., :n],
                tree.ancestors[..., :n, :n])


def chain_tree(root: jax.Array, chain: Chain, num_nodes: int) -> Tree:
    """The tree a step that did not draft leaves: the root and the lookup chain as one path (node i
    is c_i under node i - 1, path probability first * cont^(i - 1)), so the next step may verify the
    chain without running the drafter (`tree_decoding.tree_step` with `then=HOLD`). Chain slots
    without a token (-1) and nodes past the chain are never accepted; nodes past the chain are
    padding under the root. One row; vmap for rows. Its surrogate equals `lookup.chain_curve`."""
    depth = chain.tokens.shape[0]
    node = jnp.arange(num_nodes)
    on = (node >= 1) & (node <= depth)  # [n] a chain node
    pad = jnp.full((max(num_nodes - 1 - depth, 0),), -1, jnp.int32)
    tokens = jnp.concatenate([root[None].astype(jnp.int32), chain.tokens.astype(jnp.int32), pad])[:num_nodes]
    parents = jnp.where(on, node - 1, jnp.where(node == 0, -1, 0)).astype(jnp.int32)
    depths = jnp.where(on, node, 0).astype(jnp.int32)
    d = jnp.maximum(depths - 1, 0).astype(jnp.float32)
    p = chain.first * chain.cont ** d  # [n] path probability of a chain node
    log_probs = jnp.where(node == 0, 0.0, jnp.where(on & (tokens >= 0) & (p > 0), jnp.log(jnp.maximum(p, 1e-30)),
                                                    -jnp.inf)).astype(jnp.float32)
    ancestors = (node[:, None] == node[None, :]) | (node[None, :] == 0) | (on[:, None] & (node[None, :] <= node[:, None]))
    return Tree(tokens, parents, depths, log_probs, ancestors)
