"""Tree verification pieces: the accept walk and KV/feature compaction.

(The tree's attention mask is its ancestor matrix, `Tree.ancestors`: see `modeling/attention.py`.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bastion_jax.modeling.cache import KVCache, slot_index, write_slots


def walk(tokens: jax.Array, parents: jax.Array, choices: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array]:
    """Follow the target from the root: repeatedly move to the child whose token equals the current
    node's choice (siblings are distinct tokens, so at most one). One row: tokens/parents/choices [n].

    Returns (path [max_depth + 1] node indices, root first; entries past `accepted` repeat the
    last node) and `accepted` (number of draft nodes on the path).
    """

    def down(carry, _):  # one level deeper (a scan: one body to compile whatever the depth)
        cur, alive, accepted = carry
        match = (parents == cur) & (tokens == choices[cur])  # [n]
        alive = alive & match.any()
        cur = jnp.where(alive, jnp.argmax(match).astype(jnp.int32), cur)
        return (cur, alive, accepted + alive.astype(jnp.int32)), cur

    start = jnp.int32(0)
    (_, _, accepted), path = jax.lax.scan(down, (start, jnp.bool_(True), jnp.int32(0)), length=max_depth)
    return jnp.concatenate([start[None], path]), accepted


def compact_cache(cache: KVCache, start: jax.Array, path: jax.Array, active: jax.Array | None = None) -> KVCache:
    """Move the K/V of the accepted path (slots start + path[k]) to contiguous slots start + k.

    Every accepted node was computed at its true position (start + depth) seeing only its
    ancestors, so after the move the cache equals a sequential pass. path: [b, L]. Rows with
    `active[b]` False are not touched.
    """
    # A one-entry path is the root alone, already at slot start: nothing moves (and a no-op move of the
    # one-slot window makes XLA copy the whole cache buffer).
    if path.shape[1] == 1:
        return cache
    # every layer at once: [layers, b, kv_heads, max_len, d]
    src = slot_index(None, start[:, None] + path)  # the accepted nodes' slots [b, L]

    def move_all(buf):
        return write_slots(buf, None, buf[src], start, active)  # [b, L, layers, kv_heads, d] moved

    return KVCache(k=move_all(cache.k), v=move_all(cache.v))
