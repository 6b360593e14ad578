"""Token choice from logits: greedy, or temperature sampling with optional top-k / top-p.

Greedy or not is the only static choice (`StepConfig.greedy`: greedy steps compile to a plain
argmax with no RNG work). Temperature, top-k and top-p travel as arrays in a `Sampler` together
with the PRNG key, so a request with other values reuses the compiled steps. Top-k and top-p
look at the `PREFILTER` largest logits only (`lax.top_k`, no full-vocabulary sort) and fall back
to a full sort only in the rare case the answer lies outside them, so the result is always exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

PREFILTER = 256  # logits looked at by top-k / top-p before any full sort
ARGMAX_CHUNK = 1024  # logits per block of `argmax`'s first pass


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


@struct.dataclass
class Sampler:
    """The traced half of sampling: a PRNG key and the parameters as arrays."""

    key: jax.Array
    temperature: jax.Array  # [] float32 (> 0 in a sampling step)
    top_k: jax.Array  # [] int32, 0 = off
    top_p: jax.Array  # [] float32, 1 = off


def sampler(key: jax.Array, cfg: "SamplingConfig") -> Sampler:
    """`key` with `cfg`'s parameters as arrays: the sampling argument of every step."""
    return Sampler(key, jnp.float32(cfg.temperature), jnp.int32(cfg.top_k), jnp.float32(cfg.top_p))


def _descending(z: jax.Array) -> jax.Array:
    return -jnp.sort(-z, axis=-1)


def _nucleus(values: jax.Array, z: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(threshold [..., 1], mass of `values` [...]): the smallest prefix of `values` (logits sorted
    descending, a prefix of all of them) whose probability under `z` reaches top_p; its last value."""
    probs = jnp.exp(values - jax.nn.logsumexp(z, axis=-1, keepdims=True))
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    threshold = jnp.min(jnp.where(mass_before < top_p, values, jnp.inf), axis=-1, keepdims=True)
    return threshold, jnp.sum(probs, axis=-1)


def filter_logits(logits: jax.Array, s: Sampler) -> jax.Array:
    """Tempered logits with everything outside top-k / the top-p nucleus set to -inf. [..., vocab]

    Both cut-offs are read from the PREFILTER largest logits; when the answer lies beyond them for
    some row (top-k > PREFILTER, or a nucleus wider than PREFILTER tokens) the batch sorts in full.
    """
    z = logits.astype(jnp.float32) / s.temperature
    vocab = z.shape[-1]
    top = jax.lax.top_k(z, min(PREFILTER, vocab))[0]  # [..., n] descending
    k = s.top_k
    use_k = (k > 0) & (k < vocab)

    def kth(values):  # the k-th largest logit, [..., 1]
        return jnp.take(values, jnp.clip(k - 1, 0, values.shape[-1] - 1), axis=-1)[..., None]

    cut = jax.lax.cond(use_k & (k > top.shape[-1]), lambda: kth(_descending(z)), lambda: kth(top))
    z = jnp.where(use_k & (z < cut), -jnp.inf, z)
    top = jnp.where(use_k & (top < cut), -jnp.inf, top)
    threshold, covered = _nucleus(top, z, s.top_p)
    wider = (s.top_p < 1.0) & jnp.any(covered < s.top_p)  # some nucleus reaches past the prefilter
    threshold = jax.lax.cond(wider, lambda: _nucleus(_descending(z), z, s.top_p)[0], lambda: threshold)
    return jnp.where((s.top_p < 1.0) & (z < threshold), -jnp.inf, z)


def argmax(logits: jax.Array, chunk: int = ARGMAX_CHUNK) -> jax.Array:
    """`jnp.argmax(logits, axis=-1)` as int32 (the first index of the largest logit), in two passes.

    XLA:CPU runs a one-pass argmax as a scalar (value, index) reduction over the whole vocabulary:
    7.1 ms for 16 rows of SmolLM2's 49,152 logits where the logits themselves cost 5.8 (measured,
    2 cores). Here a plain max over blocks of `chunk` logits (vectorised) picks the first block holding
    the row's maximum and the index pass runs over that block only: 5.7 ms, the same answer, ties
    included. (Rows holding NaN may get another index than jnp.argmax's.) [..., vocab] -> [...]"""
    vocab = logits.shape[-1]
    blocks = vocab // chunk
    if blocks < 2:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    head = logits[..., :blocks * chunk].reshape(logits.shape[:-1] + (blocks, chunk))  # [..., blocks, chunk]
    block_max = head.max(axis=-1)  # [..., blocks]
    best = jnp.argmax(block_max, axis=-1)  # [...] the first block holding the maximum
    inside = jnp.take_along_axis(head, best[..., None, None], axis=-2)[..., 0, :]  # [..., chunk]
    index = best * chunk + jnp.argmax(inside, axis=-1)
    if blocks * chunk < vocab:  # the last vocab % chunk logits: a later index wins only if strictly larger
        tail = logits[..., blocks * chunk:]
        head_max = jnp.take_along_axis(block_max, best[..., None], axis=-1)[..., 0]
        index = jnp.where(tail.max(axis=-1) > head_max, blocks * chunk + jnp.argmax(tail, axis=-1), index)
    return index.astype(jnp.int32)


def sample(logits: jax.Array, key, greedy: bool) -> jax.Array:
    """One token per row of `logits` `[..., vocab]` -> `[...]` int32. `key` is a `Sampler` (a bare
    PRNG key is enough for a greedy step, which draws nothing)."""
    if greedy:
        return argmax(logits)
    if not isinstance(key, Sampler):
        raise TypeError("a sampling step needs a Sampler (sampling.sampler(key, SamplingConfig(...))), not a bare key")
    return jax.random.categorical(key.key, filter_logits(logits, key), axis=-1).astype(jnp.int32)
