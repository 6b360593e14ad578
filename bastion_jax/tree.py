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
    `chain` (lookup chains, see `lookup.py`: tokens [depth], or [C, depth] for C <= 2 chains with
    first / cont [C]) adds each chain's token at each depth as a candidate. A path is on the chains
    whose tokens it has followed so far; under a node on the chains H (those with a token there), each
    chain c is right with probability w_c (first at depth 1, cont deeper) independently, conditioned
    on the right ones agreeing (`_chain_rows`): for one chain, a child equal to its next token has
    probability w + (1 - w) p and any other child (1 - w) p (p the drafter's, for a chain's token
    whatever its rank); off every chain the drafter's p alone.

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
    chains = as_chains(chain)
    n_ch = 0 if chains is None else chains.tokens.shape[0]  # C: chains in the tree
    if chains is None:
        on_lp = off_lp = top_lp
        chain_tok = jnp.zeros((depth, 0), jnp.int32)  # [depth, C]
    else:
        chain_tok = chains.tokens.T.astype(jnp.int32)  # [depth, C] target ids
        col, found = _chain_columns(chain_tok, ids, vocab)  # [depth, C] each
        chain_lp = jnp.where(found, jnp.take_along_axis(log_probs, col, axis=1).astype(jnp.float32), neg_inf)
        w = jnp.where(jnp.arange(depth)[:, None] == 0, chains.first[None], chains.cont[None])  # [depth, C]
        off_lp, top_tok, on_lp = _chain_rows(top_lp, top_tok, chain_tok, w, chain_lp)  # on_lp [depth, S, k + C]
        k = k + n_ch

    def keep_best(scores: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Top m of a flat candidate list, padded with -inf when there are fewer than m."""
        if scores.shape[0] < m:
            scores = jnp.concatenate([scores, jnp.full((m - scores.shape[0],), neg_inf)])
        return jax.lax.top_k(scores, m)

    # Depth 1: children of the root (on every chain, if there are any).
    s, idx = keep_best(on_lp[0, -1] if n_ch else on_lp[0])  # [m]
    tok = jnp.where(idx < k, top_tok[0][jnp.minimum(idx, k - 1)], -1)
    on = (tok[:, None] >= 0) & (tok[:, None] == chain_tok[0][None, :])  # [m, C] still on chain c

    def expand(prev, on, pairs, on_rows, off_rows, tok_rows, chain_d):
        """The top m of (kept parents) x (their candidates) among `pairs` (parent, rank), each parent's
        row given by `*_rows(parent, rank)`. With chains, at most one kept node is on each: chain c's
        node (unless an earlier chain's node is the same one) has its row `on_rows(parent, state)` for
        the chains it is on (unsorted) taken whole, after the others. Returns (scores, on [m, C],
        parent, token) [m]."""
        ci, cj = pairs
        if not n_ch:
            s, idx = keep_best(prev[ci] + off_rows(ci, cj))  # [m] of the candidate pairs, in flat order
            parent, rank = ci[idx], cj[idx]
        else:
            specials, rows = [], []
            for c in range(n_ch):
                r = jnp.argmax(on[:, c])
                has = on[r, c] & ~jnp.any(on[r, :c])  # a node on an earlier chain too has that one's row
                state = jnp.sum(on[r].astype(jnp.int32) << jnp.arange(n_ch)) - 1  # its chains, as a mask - 1
                specials.append(r)
                rows.append(jnp.where(has, prev[r] + on_rows(r, state), neg_inf))  # [k]
            off = jnp.where(jnp.any(on, axis=1)[ci], neg_inf, prev[ci] + off_rows(ci, cj))  # [n_pairs]
            s, idx = keep_best(jnp.concatenate([off] + rows))
            n_off, kk = ci.shape[0], rows[0].shape[0]
            pair = jnp.minimum(idx, n_off - 1)  # (read only where idx < n_off: an off-chain pair)
            row = jnp.clip(idx - n_off, 0) // kk
            parent = jnp.where(idx < n_off, ci[pair], jnp.stack(specials)[row])
            rank = jnp.where(idx < n_off, cj[pair], jnp.clip(idx - n_off, 0) % kk)
        tok = tok_rows(parent, rank)
        on = on[parent] & (tok[:, None] == chain_d[None, :])
        return s, on, parent.astype(jnp.int32), tok

    shared_pairs = tuple(map(jnp.asarray, _pair_candidates(m, k, n_ch)))  # [n_pairs] each

    def deeper(carry, xs):
        """One more depth from its shared candidate row: the top m of (kept parents) x (k tokens). A
        scan, not a Python loop: one body to compile whatever the block size (XLA:GPU's compile time
        follows the kernel count)."""
        prev, on, _ = carry  # [m] scores, [m, C] bool, [m] tokens
        on_d, off_d, tok_d, chain_d = xs  # [S, k] (or [k] without chains), [k], [k], [C]
        s, on, parent, tok = expand(prev, on, shared_pairs, lambda r, state: on_d[state], lambda i, j: off_d[j],
                                    lambda i, j: tok_d[j], chain_d)
        return (s, on, tok), (s, parent, tok)

    n_cond = min(cond_depths, depth) if child_law is not None else 0  # depths 2..n_cond: per-parent laws
    carry = (s, on, tok)
    levels = [(s[None], jnp.full((1, m), -1, jnp.int32), tok[None])]
    if n_cond >= 2:
        state0 = jnp.zeros((0,), jnp.float32) if child_state is None else child_state
        carry, level = _conditioned_depths(child_law, carry, jnp.broadcast_to(state0, (m,) + state0.shape), n_cond,
                                           m, k, ids, chains, expand)
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


def _pair_candidates(m: int, k: int, n_chains: int) -> tuple[np.ndarray, np.ndarray]:
    """The (parent, rank) pairs of one depth, in flat order, that can be among its best m children.

    Why: the kept parents' scores are sorted (descending) and so is each depth's token list, so pair
    (i, j) is outscored, or tied at a lower flat index, by every (i', j') with i' <= i, j' <= j: with
    (i + 1)(j + 1) > m of them it is never kept. At k = m = 63 that leaves 273 of 3,969 pairs (a 64-node
    tree over 8,192 columns on CPU: 1.57 -> 1.41 ms). With lookup chains, the (at most one per chain)
    parents on a chain score with other (unsorted) numbers: their rows are taken whole, after the
    others (so an exact tie between an on-chain and an off-chain pair keeps the off-chain one), and
    an off-chain row i has at least i + 1 - C sorted rows at or above it (itself included), so (i, j)
    needs max(i + 1 - C, 1) (j + 1) <= m (335 pairs for one chain)."""
    i, j = np.meshgrid(np.arange(m), np.arange(k), indexing="ij")
    rows_above = np.maximum(i + 1 - n_chains, 1)
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
                        ids: jax.Array | None, chains: Chain | None, expand):
    """Depths 2..n_cond of `build_tree`, each kept parent's children from its own law: a scan over
    the depths whose body asks `child_law` for the m kept parents' rows (given the states [m, S]
    their parents handed down), takes each row's top k (and, with chains, each chain token's log-prob
    in each row) and keeps the best m pairs, each child with its parent's state."""
    neg_inf = jnp.float32(-jnp.inf)
    n_ch = 0 if chains is None else chains.tokens.shape[0]
    kk = k - n_ch  # the drafter's candidates per row (each chain adds its token as one more)

    def body(carry, d):
        prev, on, ptok, pstate = carry  # [m] scores, [m, C] bool, [m] target ids (-1: padding), [m, S]
        law, cols, state = child_law(d, jnp.maximum(ptok, 0), pstate)  # [m, C], [C] or None, [m, S]
        law = law.astype(jnp.float32)
        width = min(kk, law.shape[1])  # a law over C < kk candidate columns offers C children
        pairs = tuple(map(jnp.asarray, _cond_pairs(m, width)))
        lp, col = jax.lax.optimization_barrier(jax.lax.top_k(law, width))  # [m, width] (barrier: see build_tree)
        ids_c = ids if cols is None else (cols if ids is None else ids[cols])  # a column's token id (None: itself)
        tok = ids_c[col] if ids_c is not None else col
        chain_d = jnp.zeros((0,), jnp.int32) if not n_ch else chains.tokens[:, d].astype(jnp.int32)  # [C]
        if not n_ch:
            on_rows = off_rows = lp
        else:
            hit_col, found = _chain_columns(chain_d, ids_c, law.shape[1])  # [C] each
            chain_lp = jnp.where(found[None, :], law[:, hit_col], neg_inf)  # [m, C]
            off_rows, tok, on_rows = _chain_rows(lp, tok, jnp.broadcast_to(chain_d, (m, n_ch)),
                                                 jnp.broadcast_to(chains.cont, (m, n_ch)), chain_lp)
        s, on, parent, new_tok = expand(prev, on, pairs, lambda r, st: on_rows[r, st], lambda i, j: off_rows[i, j],
                                        lambda i, j: tok[i, j], chain_d)
        return (s, on, new_tok, state[parent]), (s, parent, new_tok)

    (s, on, tok, _), level = jax.lax.scan(body, carry + (states,), jnp.arange(1, n_cond))
    return (s, on, tok), level


def _chain_columns(tokens: jax.Array, ids: jax.Array | None, width: int) -> tuple[jax.Array, jax.Array]:
    """(column, found), each shaped like `tokens` (target ids, -1: none): the column of a law over
    `width` columns holding each token (`ids` [width] the columns' ids; None: the column is the id),
    and whether there is one (a reduced vocabulary may lack the token)."""
    if ids is None:
        return jnp.clip(tokens, 0, width - 1), tokens >= 0
    hit = ids == tokens[..., None]  # [..., width]
    return jnp.argmax(hit, axis=-1), hit.any(axis=-1) & (tokens >= 0)


def as_chains(chain: Chain | None) -> Chain | None:
    """`chain` with a leading chain axis: tokens [C, depth], first / cont [C] (one chain [depth] -> C = 1)."""
    if chain is None or chain.tokens.ndim == 2:
        return chain
    return Chain(chain.tokens[None], chain.first[None], chain.cont[None])


def _chain_rows(top_lp: jax.Array, top_tok: jax.Array, look: jax.Array, w: jax.Array, chain_lp: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The candidate rows [rows, k + C] with each chain's token added as a column (-1 / -inf off the
    chains; -1 when it is already a candidate, an earlier chain's, or none), and for each state (the
    nonempty set of chains a parent is on, indexed by its bit mask - 1) the rows' log-probs
    [rows, 2^C - 1, k + C]. Per row (a depth, or a parent of one depth): `look` [rows, C] the chains'
    tokens (-1: none), `w` [rows, C] their weights there, `chain_lp` [rows, C] the drafter's log-prob
    of each chain's token (-inf: none).

    Why this law: each chain the parent is on and that has a token ("live") is right with its own
    probability w_c, independently; the right ones must agree on the token, so the ways the chains
    can be right (a set R of live chains with one token between them, R empty: none is, and the
    drafter's p picks) are weighed prod_{c in R} w_c prod_{c live, not in R} (1 - w_c) and normalised.
    One chain: its token w + (1 - w) p, the others (1 - w) p. Two that agree: their token
    1 - (1 - w1)(1 - w2) + (1 - w1)(1 - w2) p. Two that differ: each w_c (1 - w_other) / (1 - w1 w2).
    A state with no live chain gets the drafter's numbers exactly (`off`)."""
    rows, k = top_lp.shape
    n_ch = look.shape[1]
    neg_inf = jnp.float32(-jnp.inf)
    is_cand = (top_tok[:, None, :] == look[:, :, None]) & (look[:, :, None] >= 0)  # [rows, C, k]
    dup = jnp.stack([jnp.any(look[:, :c] == look[:, c:c + 1], axis=1) for c in range(n_ch)], axis=1)  # [rows, C]
    extra = (look >= 0) & ~is_cand.any(axis=2) & ~dup  # [rows, C] chain c's token is a column of its own
    tok = jnp.concatenate([top_tok, jnp.where(extra, look, -1)], axis=1)  # [rows, k + C]
    off = jnp.concatenate([top_lp, jnp.full((rows, n_ch), neg_inf)], axis=1)
    p = jnp.concatenate([jnp.exp(top_lp), jnp.exp(chain_lp)], axis=1)  # [rows, k + C] the drafter's
    col_is = (tok[:, None, :] == look[:, :, None]) & (look[:, :, None] >= 0)  # [rows, C, k + C]
    states = []
    for mask in range(1, 2 ** n_ch):
        live = jnp.stack([(look[:, c] >= 0) & (w[:, c] > 0) & bool(mask >> c & 1) for c in range(n_ch)], 1)  # [rows, C]
        wl = jnp.where(live, w, 0.0)  # [rows, C]
        none_right = jnp.prod(1.0 - wl, axis=1)  # [rows] weight of R = {}
        in_top = jnp.arange(k + n_ch) < k
        mass = none_right[:, None] * p * (in_top[None] | jnp.any(col_is & live[:, :, None], axis=1))  # [rows, k + C]
        total = none_right
        for r in range(1, 2 ** n_ch):  # R: the chains that are right
            members = [c for c in range(n_ch) if r >> c & 1]
            ok = jnp.all(live[:, members], axis=1)
            for c in members[1:]:
                ok = ok & (look[:, c] == look[:, members[0]])
            weight = jnp.where(ok, jnp.prod(jnp.where(jnp.asarray([r >> c & 1 for c in range(n_ch)], bool)[None],
                                                      wl, 1.0 - wl), axis=1), 0.0)  # [rows]
            mass = mass + weight[:, None] * col_is[:, members[0], :]
            total = total + weight
        states.append(jnp.where(jnp.any(live, axis=1, keepdims=True), jnp.log(mass / total[:, None]), off))
    return off, tok, jnp.stack(states, axis=1)


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
