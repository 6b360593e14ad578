"""Pure, jitted autoregressive steps over (graphdef, state, cache); the engine drives them.

Lengths are arrays, never Python ints, so one compiled decode step serves every position.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from bastion_jax.modeling.cache import KVCache, causal_mask
from bastion_jax.sampling import SamplingConfig, sample


@partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnames=("cache",))
def prefill(state: nnx.State, cache: KVCache, tokens: jax.Array, lengths: jax.Array, key: jax.Array,
            *, graphdef: nnx.GraphDef, sampling: SamplingConfig):
    """Prompts right-padded to a bucket: tokens [batch, bucket], lengths [batch].

    Writes K/V for all bucket slots (slots >= length hold padding that is masked out and later
    overwritten) and samples the first new token from each row's last real position.
    Returns (first tokens [batch], cache).
    """
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    start = jnp.zeros((b,), jnp.int32)
    out = model(tokens, positions, cache, start, causal_mask(start, t, cache.max_len),
                logits_index=(lengths - 1)[:, None])
    return sample(out.logits[:, 0], key, sampling), out.cache


@partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnames=("cache",))
def decode(state: nnx.State, cache: KVCache, tokens: jax.Array, lengths: jax.Array, key: jax.Array,
           *, graphdef: nnx.GraphDef, sampling: SamplingConfig):
    """One token per row: tokens [batch] written at slot/position lengths[b]. Returns (next, cache)."""
    model = nnx.merge(graphdef, state)
    out = model(tokens[:, None], lengths[:, None], cache, lengths, causal_mask(lengths, 1, cache.max_len))
    return sample(out.logits[:, 0], key, sampling), out.cache
