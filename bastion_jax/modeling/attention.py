"""Attention whose cost follows the live context, not the size of the preallocated cache.

A decoding step's queries (one AR token, a chain block, a tree of n nodes, a drafter block) see two
kinds of keys: the committed prefix, cache slots `< length[b]`, all visible; and the step's own new
keys, visible through a small `[t, t]` mask (causal, or the tree's ancestor mask). `attend_split`
attends to the two separately and merges them exactly with their log-sum-exps:

- the prefix is read in chunks of `chunk` slots by a loop that stops after the last live slot of
  the batch (`ceil(max(length) / chunk)` trips), so a step at context 256 costs the same with a
  2,048-slot or a 16,384-slot cache; on GPU this loop is where a flash-decoding kernel plugs in;
- the new part is a dense `[t, t]` block when small, and the same chunked loop over its keys when
  long, so no `[t, t]` score matrix of a long prompt is ever materialised;
- a prefill (nothing committed, a `Causal` mask) goes tile by tile below the diagonal, up to its
  longest row, with its queries head-major (`causal`; a prompt under two tiles is one tile): half
  the work of a long prompt, no mask to build, no transposes around the products. On CPU a 2,048-token
  SmolLM2 prefill took 20 s through the masked chunk loop (two thirds of it selects and exps over
  full-width masked scores) and takes 7 s so.

Scores, running maxima and sums are float32; probabilities, rounded to the queries' dtype, meet the
values in that dtype with float32 accumulation (a cache held wider, `cache.storage_dtype`, is read
back exactly). `attend` is the dense reference (one softmax over a full mask), used
by training and by the tests that check the split against it.

`attend_canonical` is the same attention for a bf16 target on CPU, computed so that a token's
result does not depend on how the step split its keys (an AR step at p, a tree verified from any
committed length before p) or on the other queries: each query folds its keys in chunks of absolute
positions with order-exact sums. With XLA:CPU's row-independent products that makes greedy
speculative output equal to AR's bit for bit in bf16 (`layers.row_exact`).
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from bastion_jax.modeling.cache import causal_mask

NEG_INF = jnp.finfo(jnp.float32).min
PREFIX_CHUNK = 256  # cache slots per trip of the prefix loop (off CPU; see `prefix_chunk_default`)
CPU_PREFIX_CHUNK = 128  # the same on CPU, for steps of one query per row (AR)
CPU_TREE_PREFIX_CHUNK = 64  # the same on CPU, for steps of several queries per row (trees, drafts)
NEW_CHUNK = 512  # new keys per trip once a step has more than this many (long prefills)
PREFILL_TILE = 256  # queries and keys per tile of a causal prefill (`causal`)


class Partial(NamedTuple):
    """Softmax attention over a subset of the keys, not yet normalised (flash-attention state)."""

    m: jax.Array  # [b, kv_heads, groups, t] running max of the scores (NEG_INF: no key seen yet)
    l: jax.Array  # [b, kv_heads, groups, t] sum of exp(score - m)
    acc: jax.Array  # [b, kv_heads, groups, t, d] sum of exp(score - m) * value, float32


class Causal(NamedTuple):
    """The mask of a prefill, given by what defines it rather than as a `[b, t, t]` array: new token i
    sees new tokens <= i, and only the first `lengths[b]` tokens of row b are real (the rest is the
    bucket's padding, whose queries a long prefill does not attend at all)."""

    lengths: jax.Array  # [b] int32


def group_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """Queries [b, t, heads, d] as [b, t, kv_heads, groups, d]: each kv head with the query heads
    that share it (grouped-query attention), the layout `prefix` and the kernels take."""
    b, t, hq, d = q.shape
    return q.reshape(b, t, kv_heads, hq // kv_heads, d)  # [b, t, kv_heads, groups, d]


def empty(q: jax.Array, kv_heads: int) -> Partial:
    b, t, hq, d = q.shape
    stats = jnp.full((b, kv_heads, hq // kv_heads, t), NEG_INF, jnp.float32)
    return Partial(stats, jnp.zeros_like(stats), jnp.zeros((b, kv_heads, hq // kv_heads, t, d), jnp.float32))


def update(part: Partial, qg: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array | None,
           exact: bool = False) -> Partial:
    """Fold keys k, v [b, kv_heads, s, d] (the cache's order: each head's slots contiguous) into
    `part`; visible: [b or 1, t or 1, s] bool, or None when every query sees every key (no masking
    work at all).

    qg: [b, t, kv_heads, groups, d] grouped queries."""
    d = qg.shape[-1]
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k.astype(qg.dtype), preferred_element_type=jnp.float32)
    scores = scores * (d ** -0.5)  # [b, kv_heads, groups, t, s]
    if visible is not None:
        vis = visible[:, None, None]  # [b, 1, 1, t, s]
        scores = jnp.where(vis, scores, NEG_INF)
    m = jnp.maximum(part.m, scores.max(axis=-1))
    p = jnp.exp(scores - m[..., None])  # [b, kv_heads, groups, t, s]
    if visible is not None:
        p = jnp.where(vis, p, 0.0)
    scale = jnp.exp(part.m - m)  # 1 while both are NEG_INF: l and acc are still 0
    # p rounded to the compute dtype (q's) whatever the cache holds (`cache.storage_dtype`: float32
    # for a bf16 model on CPU): a step reads part of its keys from the cache and part fresh, and AR
    # and a tree split them differently, so both parts must round alike for their outputs to agree.
    if exact:
        # float32 probabilities and values, the sum of p as one more column of the same product:
        # XLA:CPU's float32 product accumulates each output along the keys in order, so exact zeros
        # (masked keys) anywhere, or more queries, leave every query's sums bit for bit as they were
        # (a reduce over the keys, or a bf16 product, pairs or vectorises its terms by position).
        v1 = jnp.concatenate([v.astype(jnp.float32), jnp.ones(v.shape[:-1] + (1,), jnp.float32)], axis=-1)
        pv1 = jnp.einsum("bkgts,bksd->bkgtd", p, v1, preferred_element_type=jnp.float32)  # [..., t, d + 1]
        return Partial(m, part.l * scale + pv1[..., -1], part.acc * scale[..., None] + pv1[..., :-1])
    pv = jnp.einsum("bkgts,bksd->bkgtd", p.astype(qg.dtype), v.astype(qg.dtype),
                    preferred_element_type=jnp.float32)
    return Partial(m, part.l * scale + p.sum(axis=-1), part.acc * scale[..., None] + pv)


def chunked(part: Partial, qg: jax.Array, read: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]],
            size: int, n_chunks: jax.Array | int, chunk: int,
            visible: Callable[[jax.Array, jax.Array], jax.Array], exact: bool = False) -> Partial:
    """Fold `size` keys in `n_chunks` trips of `chunk` slots (a traced count stops the loop at the
    live context). read(start, chunk) -> k, v [b, kv_heads, chunk, d] of slots start..; visible(slots
    [chunk], first [1]) -> [b, t or 1, chunk] says which of the chunk's slots each query sees; slots
    before `first` were folded by the previous trip (the last chunk is shifted back to fit in
    `size`, never clamped past it)."""
    chunk = min(chunk, size)

    def body(i, part):
        first = i * chunk
        start = jnp.minimum(first, size - chunk)
        k_c, v_c = read(start, chunk)
        return update(part, qg, k_c, v_c, visible(start + jnp.arange(chunk), first), exact)

    return jax.lax.fori_loop(0, n_chunks, body, part)


def _slots(k: jax.Array, v: jax.Array) -> Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]:
    """`chunked`'s read for keys k, v [b, kv_heads, S, d]: slots start..start + n of both."""

    def read(start, n):
        return jax.lax.dynamic_slice_in_dim(k, start, n, axis=2), jax.lax.dynamic_slice_in_dim(v, start, n, axis=2)

    return read


def prefix_chunk_default(queries: int) -> int:
    """Cache slots per trip of the prefix loop for steps of `queries` queries per row: on CPU
    `CPU_PREFIX_CHUNK` for one (AR) and `CPU_TREE_PREFIX_CHUNK` for more, `PREFIX_CHUNK` elsewhere
    ($BASTION_PREFIX_CHUNK, read when a step is traced, overrides all; for measuring).

    On CPU the last trip computes every slot of its chunk, live or not, and narrower trips cost
    little more each. 30 SmolLM2 layers of a 16-query tree step's prefix took 7.5 ms at context 30
    with 256-slot trips, 4.1 with 128 and 2.2 with 64, and about the same at context 700 (21.0,
    20.4, 20.7 ms); 4 queries 3.7 / 1.7 / 1.1 ms at context 30, and 64 at most ties 128 beyond.
    One query (AR) gained 2.4 -> 1.2 ms at context 30 from 128-slot trips and kept 256's speed at
    long contexts, where 64-slot ones lost (8.2 against 6.1 ms at 700): for one query a trip's fixed
    cost outweighs the slots a narrower trip skips (`benchmarks/prefix_trips.py`). Off CPU the prefix kernel reads the
    prefix where it can, and the loop keeps fewer, wider trips (a launch per op per trip)."""
    env = os.environ.get("BASTION_PREFIX_CHUNK")
    if env:  # (read at trace time: a process's steps already traced keep the trips they had)
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"BASTION_PREFIX_CHUNK must be a positive number of slots, not {env!r}")
        return int(env)
    if jax.default_backend() != "cpu":
        return PREFIX_CHUNK
    return CPU_PREFIX_CHUNK if queries <= 1 else CPU_TREE_PREFIX_CHUNK


def prefix(part: Partial, qg: jax.Array, k_cache: jax.Array, v_cache: jax.Array, length: jax.Array,
           chunk: int | None = None, layer: int | jax.Array | None = None, exact: bool = False) -> Partial:
    """Fold the committed prefix: cache slots < length[b] of k_cache, v_cache [b, kv_heads, max_len, d],
    or with `layer`, of that layer of stacked caches [layers, b, kv_heads, max_len, d], read chunk by
    chunk straight from the stacked buffer."""

    def visible(slots, first):
        return ((slots >= first)[None] & (slots[None] < length[:, None]))[:, None, :]  # [b, 1, chunk]

    chunk = chunk or prefix_chunk_default(qg.shape[1])

    if layer is None:
        size, read = k_cache.shape[2], _slots(k_cache, v_cache)
    else:
        _, b, hkv, size, d = k_cache.shape
        if size <= chunk:  # one read covers the cache (a loop over a whole-buffer slice makes XLA copy the cache)
            k_l, v_l = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False) for c in (k_cache, v_cache))
            return update(part, qg, k_l, v_l, (jnp.arange(size)[None] < length[:, None])[:, None, :], exact)

        def read(start, n):
            at, shape = (layer, 0, 0, start, 0), (1, b, hkv, n, d)
            return jax.lax.dynamic_slice(k_cache, at, shape)[0], jax.lax.dynamic_slice(v_cache, at, shape)[0]
    step = min(chunk, size)
    n_chunks = (jnp.max(length) + step - 1) // step  # trips up to the batch's last live slot
    return chunked(part, qg, read, size, n_chunks, step, visible, exact)


def new_keys(part: Partial, qg: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
             chunk: int = NEW_CHUNK) -> Partial:
    """Fold the step's own keys k, v [b, kv_heads, t_k, d] seen through mask [b, t, t_k]."""
    size = k.shape[2]
    if size <= chunk:
        return update(part, qg, k, v, mask)

    def visible(slots, first):
        cols = jnp.take(mask, slots, axis=2)  # [b, t, chunk]
        return cols & (slots >= first)[None, None]

    return chunked(part, qg, _slots(k, v), size, -(-size // chunk), chunk, visible)


def _row_blocks(cache: jax.Array, layer: int | jax.Array | None, starts: jax.Array, n: int) -> jax.Array:
    """Slots starts[b] .. starts[b] + n of each row b of a cache [b, kv_heads, S, d] (or of layer
    `layer` of stacked ones [layers, b, kv_heads, S, d]): [b, kv_heads, n, d]."""
    if layer is None:
        cache, layer = cache[None], 0
    _, b, hkv, _, d = cache.shape

    def one(row, start):
        return jax.lax.dynamic_slice(cache, (layer, row, 0, start, 0), (1, 1, hkv, n, d))[0, 0]

    return jax.vmap(one)(jnp.arange(b), starts)


def attend_canonical(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, length: jax.Array, k: jax.Array,
                     v: jax.Array, mask: jax.Array, *, layer: int | jax.Array | None = None,
                     chunk: int | None = None) -> jax.Array:
    """`attend_split` computed the same way, bit for bit, for a query at position p whatever else the
    step holds: an AR step at p, or a node at depth e of a tree verified from committed length
    L = p - e. Each query folds its keys in chunks of absolute positions [jC, (j + 1)C), in order,
    with the order-exact `update`; chunks wholly below L come from the cache (a loop shared by the
    step's queries), the chunk holding L reads the cache's slots [jC, L) beside the step's own keys,
    and the few ancestors at positions past it fold as the next chunk. The new keys' positions come
    from the mask: ancestors precede their descendants in a tree's node order, so the r-th key a
    query sees among the new ones is its ancestor at depth r (position L + r).

    Why: in bfloat16 every rounding of an activation turns a sum taken in another order into a
    different value, and an AR step and a verify split the same keys differently (cache | new at
    p vs at L): the logits of one token differed by 0.2-0.9 between them on SmolLM2, so greedy
    speculative text parted from AR's wherever two logits came that close, and run to run with the
    tree sizes chosen. With the products' rows already independent of each other on CPU (checked
    by the tests), this makes a verified token's logits equal to the AR step's, bits included.

    q: [b, t, q_heads, d]; caches as `attend_split`'s (committed slots < length[b]); k, v:
    [b, t, kv_heads, d] the step's keys (already written at slots length[b] + i); mask [b, t, t]
    an ancestor mask (self included; a chain's is causal)."""
    qg = group_queries(q, k.shape[2])
    b, t = q.shape[:2]
    if isinstance(mask, Causal):
        mask = causal_mask(b, t)
    k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [b, kv_heads, t, d]
    size = k_cache.shape[-2]
    chunk = min(chunk or prefix_chunk_default(1), size)
    j0 = length // chunk  # [b] the chunk holding position L
    part = prefix(empty(q, k.shape[1]), qg, k_cache, v_cache, j0 * chunk, chunk, layer, exact=True)
    start = jnp.minimum(j0 * chunk, size - chunk)  # (a cache of whole chunks never clamps)
    blk_k = jnp.concatenate([_row_blocks(k_cache, layer, start, chunk), k.astype(k_cache.dtype)], axis=2)
    blk_v = jnp.concatenate([_row_blocks(v_cache, layer, start, chunk), v.astype(v_cache.dtype)], axis=2)
    slots = start[:, None] + jnp.arange(chunk)[None]  # [b, chunk]
    cached = ((slots >= j0[:, None] * chunk) & (slots < length[:, None]))[:, None, :]  # [b, 1, chunk]
    pos = length[:, None, None] + jnp.cumsum(mask, axis=-1) - 1  # [b, t, t] position of each visible key
    nxt = ((j0 + 1) * chunk)[:, None, None]
    here = jnp.concatenate([jnp.broadcast_to(cached, (b, t, chunk)), mask & (pos < nxt)], axis=-1)  # [b, t, chunk + t]
    part = update(part, qg, blk_k, blk_v, here, exact=True)
    if t > 1:  # (a single query sits at L itself: nothing past its chunk)
        part = update(part, qg, k, v, mask & (pos >= nxt), exact=True)
    return finish(part, q.dtype)


def prefill_tile_size(t: int, tile: int = PREFILL_TILE) -> int | None:
    """The tile a causal prefill of t tokens attends in (`causal`): `tile` when t is a multiple of it,
    the whole prompt as one tile below two tiles (the CPU's finer prompt buckets, `shapes.prefill_bucket`),
    else None (the masked path of `attend_split`: never a bucket of ours)."""
    if t % tile == 0:
        return tile
    return t if t < 2 * tile else None


def causal(qg: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tile: int = PREFILL_TILE) -> Partial:
    """Causal attention of t queries over their own t keys (a prefill: nothing committed before them),
    in tiles of `tile` queries x `tile` keys: query tile i folds key tiles 0..i-1 unmasked and its
    diagonal tile through a lower-triangular mask, and never touches the tiles above the diagonal.
    Half the work of folding every key through a `[t, t]` mask, no mask to build or gather, and no
    score matrix larger than [groups * tile, tile] per kv head. Query tiles past the batch's longest
    row, lengths [b], are padding and not attended (their output is 0). qg: [b, t, kv_heads, groups,
    d] (t a multiple of `tile`); k, v: [b, kv_heads, t, d].

    The queries are laid out head-major once, [b * kv_heads, groups * tile, d] per tile, so that every
    product is a plain batched one (batch, rows, contraction last). Given `update`'s token-major
    queries, XLA:CPU transposed the queries and the scores around each product instead: the copies
    took as long as the products (SmolLM2, bf16, 2-core EPYC, one layer: 256 / 448 / 1,024 / 2,048
    tokens 2.6 / 5.4 / 17.5 / 61.9 ms -> 1.3 / 3.5 / 10.3 / 37.5 ms)."""
    b, t, hkv, g, d = qg.shape
    n = b * hkv
    qh = qg.transpose(0, 2, 3, 1, 4)  # [b, kv_heads, groups, t, d]
    kh, vh = k.reshape(n, t, d), v.reshape(n, t, d)  # [n, t, d]
    rows = jnp.arange(g * tile) % tile  # a tile's query rows, group by group
    diagonal = jnp.arange(tile)[None, :] <= rows[:, None]  # [groups * tile, tile]

    def fold(c: tuple, q_i: jax.Array, k_j: jax.Array, v_j: jax.Array, visible: jax.Array | None) -> tuple:
        m, l, acc = c  # [n, g * tile], [n, g * tile], [n, g * tile, d]
        scores = jnp.einsum("nqd,nsd->nqs", q_i, k_j.astype(q_i.dtype), preferred_element_type=jnp.float32)
        scores = scores * (d ** -0.5)  # [n, g * tile, tile]
        if visible is not None:  # (the diagonal tile: every query sees itself, so no row is all masked)
            scores = jnp.where(visible[None], scores, NEG_INF)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        p = jnp.exp(scores - m_new[..., None])
        scale = jnp.exp(m - m_new)
        pv = jnp.einsum("nqs,nsd->nqd", p.astype(q_i.dtype), v_j.astype(q_i.dtype), preferred_element_type=jnp.float32)
        return m_new, l * scale + p.sum(axis=-1), acc * scale[..., None] + pv

    def query_tile(i, part):
        q_i = jax.lax.dynamic_slice_in_dim(qh, i * tile, tile, axis=3).reshape(n, g * tile, d)
        stats = jnp.full((n, g * tile), NEG_INF, jnp.float32)
        init = (stats, jnp.zeros_like(stats), jnp.zeros((n, g * tile, d), jnp.float32))

        def key_tile(j, c):
            k_j, v_j = (jax.lax.dynamic_slice_in_dim(x, j * tile, tile, axis=1) for x in (kh, vh))
            return fold(c, q_i, k_j, v_j, None)

        c = jax.lax.fori_loop(0, i, key_tile, init)  # left of the diagonal
        k_i, v_i = (jax.lax.dynamic_slice_in_dim(x, i * tile, tile, axis=1) for x in (kh, vh))
        c = fold(c, q_i, k_i, v_i, diagonal)
        return Partial(*(jax.lax.dynamic_update_slice_in_dim(whole, x.reshape(whole.shape[:3] + (tile,) + x.shape[2:]),
                                                             i * tile, axis=3)
                         for whole, x in zip(part, c)))

    skipped = empty(qg.reshape(b, t, hkv * g, d), hkv)
    if t == tile:  # one tile: no loops (they cost the compile ~0.5 s per 30 layers, and there is nothing to skip)
        return query_tile(0, skipped)
    skipped = skipped._replace(l=jnp.ones_like(skipped.l))  # finish() gives 0, not 0 / 0, where not attended
    return jax.lax.fori_loop(0, (jnp.max(lengths) + tile - 1) // tile, query_tile, skipped)


def finish(part: Partial, dtype: jnp.dtype) -> jax.Array:
    """Normalise: [b, kv_heads, groups, t, d] -> [b, t, q_heads * d]. Every query has seen a key."""
    b, hkv, g, t, d = part.acc.shape
    out = part.acc / part.l[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * g * d).astype(dtype)


def attend_split(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, length: jax.Array | None, k: jax.Array,
                 v: jax.Array, mask: jax.Array | Causal, *, layer: int | jax.Array | None = None,
                 prefix_chunk: int | None = None, new_chunk: int = NEW_CHUNK,
                 prefill_tile: int = PREFILL_TILE) -> jax.Array:
    """Attention of q [b, t, q_heads, d] over the cache prefix (slots < length[b] of k_cache/v_cache
    [b, kv_heads, max_len, d], or of layer `layer` of stacked ones [layers, b, kv_heads, max_len, d])
    and the new keys k, v [b, t_k, kv_heads, d] (as the projections give them) through mask
    [b, t, t_k], or a `Causal` mask, which a prefill attends tile by tile (`causal`, `prefill_tile_size`).

    `length` None says, at trace time, that nothing is committed (a prefill): the prefix is not
    read at all. (A constant zero length gives the same result, but XLA:GPU then constant-folds the
    loop body's all-masked scores, tens of seconds per compile at SmolLM2 batch 128.)

    Both cache forms stay public: the models keep every layer in one stacked buffer (fewer arguments
    per step) and pass `layer`; code that keeps one cache per layer passes that buffer alone. The
    tests check both against the same brute-force reference.

    Returns [b, t, q_heads * d]; equal to `attend` over [prefix | new] up to float rounding."""
    qg = group_queries(q, k.shape[2])
    t = q.shape[1]
    k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [b, kv_heads, t_k, d]: the cache's order
    if isinstance(mask, Causal):
        tile = prefill_tile_size(t, prefill_tile) if length is None else None
        if tile is not None:
            return finish(causal(qg, k, v, mask.lengths, tile), q.dtype)
        mask = causal_mask(q.shape[0], t)
    slots = k_cache.shape[-2]
    kernel = prefix_kernel_mode(q.shape[-1], slots)
    if length is None:
        part = empty(q, k.shape[1])
    elif kernel is None:
        part = prefix(empty(q, k.shape[1]), qg, k_cache, v_cache, length, prefix_chunk, layer)
    else:
        from bastion_jax.modeling import prefix_kernel

        part = prefix_kernel.prefix(qg, k_cache, v_cache, length, layer, interpret=kernel == "interpret")
    return finish(new_keys(part, qg, k, v, mask, new_chunk), q.dtype)


# -- the prefix kernel switch --------------------------------------------------------------------
# Read when a step is traced, so it applies to the steps compiled after it is set.
_PREFIX_KERNEL = "auto"
PREFIX_KERNEL_MODES = ("auto", "xla", "pallas", "interpret")


def set_prefix_kernel(mode: str) -> str:
    """How `attend_split` reads the committed prefix in the steps compiled from now on: "auto" (the
    Pallas kernel on GPU, the XLA loop elsewhere), "xla" (the loop), "pallas" (the kernel), or
    "interpret" (the kernel through the Pallas interpreter: any backend, slow; for tests).
    Returns the previous mode."""
    global _PREFIX_KERNEL
    if mode not in PREFIX_KERNEL_MODES:
        raise ValueError(f"unknown prefix attention mode {mode!r} (one of {', '.join(PREFIX_KERNEL_MODES)})")
    old, _PREFIX_KERNEL = _PREFIX_KERNEL, mode
    return old


def prefix_kernel_setting() -> str:
    """The current `set_prefix_kernel` mode (what a cached trace must be keyed by)."""
    return _PREFIX_KERNEL


def prefix_kernel_mode(head_dim: int, slots: int) -> str | None:
    """None (the XLA loop), "pallas" or "interpret" for a step of these shapes under the current mode
    (shapes the kernel does not take keep the loop)."""
    from bastion_jax.modeling import prefix_kernel

    mode = _PREFIX_KERNEL
    if mode == "auto":
        mode = "pallas" if jax.default_backend() == "gpu" else "xla"
    if mode == "xla" or not prefix_kernel.usable(head_dim, slots):
        return None
    return mode


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Dense grouped-query attention over every key with a full mask (the reference; training).

    q: [batch, q_len, q_heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim];
    mask: [batch, q_len, kv_len] bool (True = visible). Returns [batch, q_len, q_heads * head_dim].
    Every query must see at least one key (it always sees itself in our uses).
    """
    b, t, hq, d = q.shape
    qg = group_queries(q, k.shape[2])  # [b, t, kv_heads, groups, d]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [b, kv_heads, groups, t, s]
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, hq * d)
