"""Pure, jitted autoregressive steps over (cfg, state, cache); the engine drives them.

Lengths are arrays, never Python ints, so one compiled decode step serves every position.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from bastion_jax.modeling.attention import Causal
from bastion_jax.modeling.cache import KVCache, causal_mask
from bastion_jax.sampling import Sampler, argmax, sample
from bastion_jax.step_config import StepConfig


def prefill_target(target, cache: KVCache, tokens: jax.Array, lengths: jax.Array, key: Sampler,
                   tap_layers: tuple[int, ...]):
    """Prompts right-padded to a bucket [b, t] -> (first token [b], cache, features [b, t, F]).

    Writes K/V for all bucket slots (slots >= length hold padding that is masked out and later
    overwritten) and samples the first new token from each row's last real position. Features
    are zeros of width 1 when nothing is tapped (a proposal-only engine has no drafter).
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = target(tokens, positions, cache, None, Causal(lengths),  # attended tile by tile up to the prompt
                 tap_layers=tap_layers, logits_index=(lengths - 1)[:, None])
    features = out.taps if out.taps is not None else jnp.zeros((b, t, 1), jnp.float32)
    return sample(out.logits[:, 0], key), out.cache, features


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill(cfg: StepConfig, state: nnx.State, cache: KVCache, tokens: jax.Array, lengths: jax.Array,
            key: Sampler):
    """AR prefill: tokens [batch, bucket] right-padded, lengths [batch] -> (cache, first tokens [batch]).

    The AR policy's state is its KV cache: (state, outputs) as every other step returns."""
    first, cache, _ = prefill_target(nnx.merge(cfg.target_def, state), cache, tokens, lengths, key, ())
    return cache, first


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode(cfg: StepConfig, state: nnx.State, cache: KVCache, tokens: jax.Array, lengths: jax.Array, key: Sampler,
           active: jax.Array | None = None):
    """One token per row: tokens [batch] written at slot/position lengths[b] (not for rows with
    `active[b]` False: finished rows of a batch). Returns (cache, next tokens [batch])."""
    model = nnx.merge(cfg.target_def, state)
    out = model(tokens[:, None], lengths[:, None], cache, lengths, causal_mask(tokens.shape[0], 1),
                active=active)
    return out.cache, sample(out.logits[:, 0], key)


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def forward(cfg: StepConfig, state: nnx.State, cache: KVCache, tokens: jax.Array, lengths: jax.Array):
    """A plain causal forward of tokens [batch, t] at slots lengths[b] + i (no taps): (the cache, the
    greedy token after each position [batch, t]), the order of every step. The profiler's yardstick for a tree verify of the
    same t tokens (which adds the tree mask, the taps and the accept walk)."""
    model = nnx.merge(cfg.target_def, state)
    b, t = tokens.shape
    out = model(tokens, lengths[:, None] + jnp.arange(t)[None], cache, lengths, causal_mask(b, t))
    return out.cache, argmax(out.logits)
