"""Token choice from logits: greedy, or temperature sampling with optional top-k / top-p.

`SamplingConfig` is frozen and hashable: it is a static argument of the jitted steps, so greedy
decoding compiles to a plain argmax with no RNG work.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Tempered logits with everything outside top-k / the top-p nucleus set to -inf. [..., vocab]"""
    logits = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < cfg.top_p  # smallest prefix whose mass reaches top_p
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """One token per row of `logits` `[..., vocab]` -> `[...]` int32."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, cfg), axis=-1).astype(jnp.int32)
