"""The committed-prefix part of `attend_split` as one Pallas kernel (flash-decoding), for GPUs.

On GPU the XLA loop of `attention.prefix` launches a few small kernels per 256-slot chunk and
layer; this kernel reads each row's live slots straight from the cache in its own
`[batch, kv_heads, slots, head_dim]` layout (no transpose, no copy of the cache; each head's block of
slots is one contiguous run), for every query of
the step at once: a tree's n nodes x a kv head's query group are the rows of one matrix, since every
query sees the whole prefix (the tree mask only concerns the step's own keys), cut into blocks of at
most MAX_ROWS rows (each block reads the prefix once: once per step up to 16 tree nodes at 4 query
heads per kv head).

Grid: (batch, kv_heads, row blocks, splits). Each program folds the live slots of its split (`slots / splits`
of the cache, stopping at the row's length) block by block with the running max / sum of flash
attention, and writes its unnormalised partial; the splits are merged afterwards by log-sum-exp,
giving the `Partial` that `attention.new_keys` goes on from. Scores and sums are float32; the
probabilities meet the values in the values' dtype, accumulated in float32, as in `attention.update`.

`interpret=True` runs the same kernel body through the Pallas interpreter on any backend: the tests
check it against the XLA loop on CPU. `usable` says whether shapes suit the Triton lowering (power-
of-two head_dim, a cache length divisible by the key block); otherwise `attention` keeps its loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from bastion_jax.modeling.attention import NEG_INF, Partial

BLOCK_K = 64  # cache slots per inner iteration
MAX_SPLITS = 16  # programs per (row, kv head) along the cache: parallelism for short batches
MAX_ROWS = 64  # query rows per program: 256 rows (verify(64) x 4 query heads per kv head) asked an H100
# for 320 KiB of shared memory (it has 227 KiB), so wider steps take several row blocks


def _pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def usable(head_dim: int, slots: int, block_k: int = BLOCK_K) -> bool:
    """Shapes the kernel handles: a power-of-two head_dim >= 16 and a cache of whole key blocks."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and slots % block_k == 0


def _splits(slots: int, block_k: int) -> int:
    """The most splits (<= MAX_SPLITS, a power of two) that cut the cache into whole key blocks."""
    blocks, n = slots // block_k, MAX_SPLITS
    while blocks % n:
        n //= 2
    return n


def _kernel(offset_ref, length_ref, q_ref, k_ref, v_ref, acc_ref, l_ref, m_ref, *, block_k: int, split_len: int,
            scale: float):
    """One (row, kv head, row block, split): q_ref [R, d] (R <= MAX_ROWS); k_ref, v_ref the whole cache
    [rows, kv_heads, slots, d] (this program reads row offset + its batch row, its kv head, its split's
    slots, block by block);
    writes acc [R, d], l and m [R] of the live slots (< length) in the split."""
    row, head, split = offset_ref[()] + pl.program_id(0), pl.program_id(1), pl.program_id(3)
    first = split * split_len
    length = length_ref[()]
    n_blocks = jnp.clip(pl.cdiv(length - first, block_k), 0, split_len // block_k)
    q = q_ref[...]  # [R, d]
    rows = q.shape[0]

    def body(i, carry):
        acc, l, m = carry
        at = pl.ds(first + i * block_k, block_k)
        k = k_ref[row, head, at, :]  # [block_k, d]
        live = (first + i * block_k + jnp.arange(block_k)) < length  # [block_k]
        v = jnp.where(live[:, None], v_ref[row, head, at, :], 0)  # stale slots never reach the output, even as 0 * nan
        s = jnp.dot(q, k.astype(q.dtype).T, preferred_element_type=jnp.float32) * scale  # [R, block_k]
        s = jnp.where(live[None, :], s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(live[None, :], jnp.exp(s - m_new[:, None]), 0.0)  # [R, block_k]
        corr = jnp.exp(m - m_new)
        pv = jnp.dot(p.astype(q.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32)  # [R, d] as `update`
        return acc * corr[:, None] + pv, l * corr + p.sum(axis=-1), m_new

    init = (jnp.zeros((rows, q.shape[1]), jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.full((rows,), NEG_INF, jnp.float32))
    acc, l, m = jax.lax.fori_loop(0, n_blocks, body, init)
    acc_ref[...] = acc
    l_ref[...] = l
    m_ref[...] = m


@functools.partial(jax.jit, static_argnames=("block_k", "interpret"))
def prefix(qg: jax.Array, k_cache: jax.Array, v_cache: jax.Array, length: jax.Array, layer: jax.Array | int | None = None,
           *, block_k: int = BLOCK_K, interpret: bool = False) -> Partial:
    """Attention partial of qg [b, t, kv_heads, groups, d] over slots < length[b] of k_cache, v_cache
    [b, kv_heads, slots, d] (or, with `layer`, of that layer of stacked caches [layers, b, kv_heads,
    slots, d], read in place): what `attention.prefix` computes from an empty partial."""
    b, t, hkv, g, d = qg.shape
    offset = jnp.zeros((), jnp.int32)
    if layer is not None:  # [layers * b, kv, slots, d]: a free reshape; the kernel reads rows layer * b + i
        offset = jnp.asarray(layer, jnp.int32) * b
        k_cache, v_cache = (c.reshape((-1,) + c.shape[2:]) for c in (k_cache, v_cache))
    slots = k_cache.shape[2]
    splits = _splits(slots, block_k)
    split_len = slots // splits
    rows = g * t
    r_pad = _pow2_at_least(rows)
    r_block = min(r_pad, MAX_ROWS)  # both powers of two: r_pad is whole row blocks
    q = qg.transpose(0, 2, 3, 1, 4).reshape(b, hkv, rows, d)  # [b, kv_heads, groups * t, d]: Partial's order
    q = jnp.pad(q, ((0, 0), (0, 0), (0, r_pad - rows), (0, 0)))
    kernel = functools.partial(_kernel, block_k=block_k, split_len=split_len, scale=d ** -0.5)
    acc, l, m = pl.pallas_call(
        kernel,
        grid=(b, hkv, r_pad // r_block, splits),
        in_specs=[
            pl.BlockSpec((), lambda i, h, r, j: ()),  # row offset: layer * b, or 0
            pl.BlockSpec((None,), lambda i, h, r, j: (i,)),  # length[b]
            pl.BlockSpec((None, None, r_block, d), lambda i, h, r, j: (i, h, r, 0)),  # q
            pl.BlockSpec(memory_space=pl.ANY),  # k cache: the kernel indexes it, in place
            pl.BlockSpec(memory_space=pl.ANY),  # v cache
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, r_block, d), lambda i, h, r, j: (j, i, h, r, 0)),
            pl.BlockSpec((None, None, None, r_block), lambda i, h, r, j: (j, i, h, r)),
            pl.BlockSpec((None, None, None, r_block), lambda i, h, r, j: (j, i, h, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, b, hkv, r_pad, d), jnp.float32),  # acc
            jax.ShapeDtypeStruct((splits, b, hkv, r_pad), jnp.float32),  # l
            jax.ShapeDtypeStruct((splits, b, hkv, r_pad), jnp.float32),  # m
        ],
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),  # the Triton backend on GPU
        interpret=interpret,
        name="bastion_prefix_attention",
    )(offset, length.astype(jnp.int32), q, k_cache, v_cache)
    # Merge the splits by log-sum-exp (a split with no live slot has m = NEG_INF, l = 0, acc = 0).
    m_all = m.max(axis=0)  # [b, kv_heads, R]
    corr = jnp.exp(m - m_all[None])  # [splits, b, kv_heads, R]
    l_all = (l * corr).sum(axis=0)
    acc_all = (acc * corr[..., None]).sum(axis=0)  # [b, kv_heads, R, d]
    m_all, l_all, acc_all = m_all[:, :, :rows], l_all[:, :, :rows], acc_all[:, :, :rows]
    return Partial(m_all.reshape(b, hkv, g, t), l_all.reshape(b, hkv, g, t), acc_all.reshape(b, hkv, g, t, d))
