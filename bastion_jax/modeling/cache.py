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
    k: tuple[jax.Array, ...]  # per layer [batch, max_len, kv_heads, head_dim]
    v: tuple[jax.Array, ...]  # per layer [batch, max_len, kv_heads, head_dim]

    @classmethod
    def create(cls, cfg: TargetConfig | DrafterConfig, batch: int, max_len: int, dtype: jnp.dtype) -> "KVCache":
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers))
        return cls(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers)))

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


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
