"""Static, preallocated KV cache with a batch axis.

The cache holds only buffers; how much of each row is committed (its length) is bookkeeping the
caller keeps, so rolling back a rejected draft is free: lower the length and the stale slots are
masked out and later overwritten.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from bastion_jax.config import TargetConfig
from bastion_jax.dflash_config import DrafterConfig


def storage_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype a cache of keys and values computed in `dtype` is held in: `dtype`, except bf16 / f16
    on CPU, held in float32 (exactly the same values; twice the bytes). XLA:CPU has no fast kernel for
    attention's small bf16 products, so it multiplies them in float32, and converting each chunk it
    reads became, hoisted out of the prefix loop, converting every layer's whole cache in each layer
    (80 of the 134 ms of a bf16 SmolLM2 AR step). Attention reads the chunks back in the compute dtype
    (`attention.update`: exact), so the arithmetic is the bf16 one."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize < 4 and jnp.issubdtype(dtype, jnp.floating) and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    return dtype


@struct.dataclass
class KVCache:
    """Every layer's keys and values as one stacked buffer each, `[layers, batch, kv_heads, max_len,
    head_dim]`, whether the layers run unrolled or under a scan.

    One buffer per kind, not one per layer: every buffer is an argument of each jitted step, and on
    CPU the host's dispatch of a step costs a few microseconds per argument, cache-cold after the
    step before (SmolLM2's 60 per-layer buffers were ~0.2 ms of a ~25 ms tree step). Layers write with
    `write_layer(i, ...)` (one scatter into layer i's rows, in place when the cache is donated) and
    attention reads layer i's live slots chunk by chunk straight from the stacked buffer (`layer(i)`),
    so no layer's buffer is ever sliced out whole.

    Slots sit inside the kv-head axis: a chunk of one head's live slots is one contiguous
    [chunk, head_dim] run, the operand layout attention's products take as it is. With slots
    outside the heads ([.., max_len, kv_heads, d]) each chunk was strided and XLA:CPU copied every
    chunk out before its products (~5 of an AR step's 29 ms on SmolLM2 at context 130); on GPU the
    prefix kernel reads each head's block as one contiguous run too."""

    k: jax.Array  # [layers, batch, kv_heads, max_len, head_dim]
    v: jax.Array

    @classmethod
    def create(cls, cfg: TargetConfig | DrafterConfig, batch: int, max_len: int, dtype: jnp.dtype) -> "KVCache":
        """A zeroed cache for a model computing in `dtype` (held as `storage_dtype(dtype)`)."""
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        dtype = storage_dtype(dtype)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def layer(self, i: int | jax.Array) -> tuple[jax.Array, jax.Array, int | jax.Array]:
        """What attention reads for layer i: the stacked buffers and the layer's index in them."""
        return self.k, self.v, i

    def write_layer(self, i: int | jax.Array, k: jax.Array, v: jax.Array, start: jax.Array,
                    active: jax.Array | None = None) -> "KVCache":
        """Write layer i's new k, v [batch, t, kv_heads, d] at per-row slots start[b] + j (rows with
        active[b] False keep what they had)."""
        return KVCache(k=write_layer_rows(self.k, i, k, start, active), v=write_layer_rows(self.v, i, v, start, active))

    def write_all(self, k: jax.Array, v: jax.Array, start: jax.Array, active: jax.Array | None = None) -> "KVCache":
        """Write every layer's new k, v [layers, batch, t, kv_heads, d] at slots start[b] + j, as one scatter."""
        return KVCache(k=write_layer_rows(self.k, None, k, start, active), v=write_layer_rows(self.v, None, v, start, active))


def write_layer_rows(buf: jax.Array, layer: int | jax.Array | None, new: jax.Array, start: jax.Array,
                     active: jax.Array | None = None) -> jax.Array:
    """`write_rows` into layer `layer` of a stacked buffer [layers, batch, kv_heads, max_len, d]
    (every layer when `layer` is None), as one scatter: inside a scan over layers the buffer is
    updated in place. new: [batch, t, kv_heads, d] for one layer, [layers, batch, t, kv_heads, d] for
    every layer."""
    if layer is None:
        new = jnp.moveaxis(new, 0, 2)  # [b, t, layers, kv_heads, d]: the order `slot_index` selects in
    return write_slots(buf, layer, new, start, active)


def slot_index(layer: int | jax.Array | None, slots: jax.Array) -> tuple:
    """The index of slots[b, j] of every row b of a stacked buffer [layers, b, kv_heads, max_len, d],
    in one layer or (`layer` None) in all. Row and slot indices are split by the heads' slice, so what
    it selects is ordered [b, t, (layers,) kv_heads, d] (NumPy's rule for separated advanced indices)."""
    rows = jnp.arange(slots.shape[0])[:, None]  # [b, 1]
    return (slice(None), rows, slice(None), slots) if layer is None else (layer, rows, slice(None), slots)


def write_slots(buf: jax.Array, layer: int | jax.Array | None, new: jax.Array, start: jax.Array,
                active: jax.Array | None = None) -> jax.Array:
    """Write `new`, ordered as `slot_index` selects ([b, t, (layers,) kv_heads, d]), at slots
    start[b] + j of layer `layer` (or of every layer) of a stacked buffer; rows with active[b] False
    keep what they had."""
    at = slot_index(layer, start[:, None] + jnp.arange(new.shape[1])[None])  # slots [b, t]
    new = new.astype(buf.dtype)
    if active is not None:  # finished rows keep what they had
        new = jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, buf[at])
    return buf.at[at].set(new)


def write_rows(buf: jax.Array, new: jax.Array, start: jax.Array, active: jax.Array | None = None) -> jax.Array:
    """Write `new` `[batch, t, ...]` into `buf` `[batch, max_len, ...]` at per-row slot `start[b]`.

    Rows with `active[b]` False (finished rows of a batch) are left exactly as they were: a batch
    step still computes them (shapes are static), but nothing they compute lands in a cache.
    Callers guarantee `start + t <= max_len` (checked on the host), since dynamic_update_slice
    would otherwise clamp the offset and silently shift the write.
    """

    def one(row: jax.Array, upd: jax.Array, s: jax.Array, keep_new: jax.Array) -> jax.Array:
        idx = (s,) + (0,) * (row.ndim - 1)
        upd = upd.astype(row.dtype)
        old = jax.lax.dynamic_slice(row, idx, upd.shape)
        return jax.lax.dynamic_update_slice(row, jnp.where(keep_new, upd, old), idx)

    if active is None:
        active = jnp.ones(buf.shape[:1], bool)
    return jax.vmap(one)(buf, new, start, active)


def causal_mask(batch: int, t: int) -> jax.Array:
    """Visibility `[batch, t, t]` among t new tokens written in order: token i sees tokens <= i.

    (Committed slots, those before the first new one, are always visible; see `Transformer`.)"""
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


def append_rows(buf: jax.Array, new: jax.Array, start: jax.Array, count: jax.Array) -> jax.Array:
    """`buf` [b, L, ...] with each row's first `count[b]` rows of `new` [b, t, ...] written at slots
    start[b]..; the rest of `new`, and anything past the buffer, is dropped (never clamped onto other
    slots, unlike `write_rows`). For small per-row buffers whose fill varies: the token history, the
    feature buffer of steps that did not draft."""
    b, t = new.shape[:2]
    slot = start[:, None] + jnp.arange(t)[None]  # [b, t]
    slot = jnp.where(jnp.arange(t)[None] < count[:, None], slot, buf.shape[1])  # out of range: dropped
    return buf.at[jnp.arange(b)[:, None], slot].set(new.astype(buf.dtype), mode="drop")
