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


@struct.dataclass
class KVCache:
    """Every layer's keys and values, in one of two layouts:

    - per layer (a tuple of `[batch, max_len, kv_heads, head_dim]` buffers), for unrolled layers:
      each layer's buffer is its own argument of the step;
    - stacked (one `[layers, batch, max_len, kv_heads, head_dim]` buffer), for layers run by a
      scan: the buffer rides in the scan's carry and each layer updates its rows in place.

    Layers write with `write_layer(i, ...)` and read with `layer(i)`, whatever the layout."""

    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array

    @classmethod
    def create(cls, cfg: TargetConfig | DrafterConfig, batch: int, max_len: int, dtype: jnp.dtype) -> "KVCache":
        """Stacked when `cfg` scans its layers (`TargetConfig.scan_layers`), else per layer."""
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        n = cfg.num_hidden_layers
        if getattr(cfg, "scan_layers", False):
            return cls(k=jnp.zeros((n,) + shape, dtype), v=jnp.zeros((n,) + shape, dtype))
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(n)), v=tuple(jnp.zeros(shape, dtype) for _ in range(n)))

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    @property
    def batch(self) -> int:
        return self.k.shape[1] if self.stacked else self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k.shape[2] if self.stacked else self.k[0].shape[1]

    def layer(self, i: int | jax.Array) -> tuple[jax.Array, jax.Array, int | jax.Array | None]:
        """What attention reads for layer i: (k, v, layer index) of the stacked buffers, or (k, v,
        None) with that layer's own [batch, max_len, ...] buffers."""
        if self.stacked:
            return self.k, self.v, i
        return self.k[i], self.v[i], None

    def write_layer(self, i: int | jax.Array, k: jax.Array, v: jax.Array, start: jax.Array,
                    active: jax.Array | None = None) -> "KVCache":
        """Write layer i's new k, v [batch, t, kv_heads, d] at per-row slots start[b] + j (rows with
        active[b] False keep what they had). Per layer, i must be a Python int."""
        if self.stacked:
            return KVCache(k=write_layer_rows(self.k, i, k, start, active), v=write_layer_rows(self.v, i, v, start, active))
        ks, vs = list(self.k), list(self.v)
        ks[i], vs[i] = write_rows(ks[i], k, start, active), write_rows(vs[i], v, start, active)
        return KVCache(k=tuple(ks), v=tuple(vs))


def write_layer_rows(buf: jax.Array, layer: int | jax.Array | None, new: jax.Array, start: jax.Array,
                     active: jax.Array | None = None) -> jax.Array:
    """`write_rows` into layer `layer` of a stacked buffer [layers, batch, max_len, ...] (every layer
    when `layer` is None, `new` then [layers, batch, t, ...]), as one scatter: inside a scan over
    layers the buffer is updated in place."""
    lead = 1 if layer is None else 0  # new's own layer axis
    b, t = new.shape[lead], new.shape[lead + 1]
    rows = jnp.arange(b)[:, None]  # [b, 1]
    slots = start[:, None] + jnp.arange(t)[None]  # [b, t]
    at = (slice(None), rows, slots) if layer is None else (layer, rows, slots)
    new = new.astype(buf.dtype)
    if active is not None:  # finished rows keep what they had
        keep = active[:, None, None, None] if layer is not None else active[None, :, None, None, None]
        new = jnp.where(keep, new, buf[at])
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
