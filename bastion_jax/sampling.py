"""Token choice from logits: greedy, or temperature sampling with optional top-k / top-p.

Nothing about sampling is static: temperature, top-k and top-p travel as arrays in a `Sampler`
together with the PRNG key, and greedy (temperature 0) is a traced branch (`lax.cond`: a greedy
step runs only the argmax), so a request with other values, greedy or not, reuses the compiled
steps (the cond costs ~0.01-0.03 ms a call on CPU; on XLA:GPU a conditional outside a command buffer
reads its predicate on the host, a stream sync per step whose cost is not measured yet: a GPU
lease's perf_8b AR step against its HBM floor is where it would show). Top-k and top-p
look at the `PREFILTER` largest logits only (`lax.top_k`, no full-vocabulary sort) and fall back
to a bisection over the whole vocabulary only when the answer lies outside them, so the result is
always exact and nothing sorts the vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

PREFILTER = 256  # logits top-k / top-p look at first (past them: a bisection over the whole row)
ARGMAX_CHUNK = 1024  # logits per block: `argmax`'s first pass and `draw`'s block sums


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if not self.temperature >= 0 or self.temperature == float("inf"):  # NaN fails every comparison
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
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


class KeyStream:
    """A request's per-step sampling keys (host side), split on the device `CHUNK` at a time.

    One eager `jax.random.split` per step cost ~0.5 ms of host time on CPU (a dispatch, then the
    next step waits on it); a chunk costs about that once per `CHUNK` steps and is read to the host
    once, so each step's key goes in as a NumPy array (the executable's own transfer). The first
    `CHUNK` keys of `split(rng, CHUNK + 1)` are the steps', the last one the next chunk's rng."""

    CHUNK = 64

    def __init__(self, rng: jax.Array):
        self._rng = rng
        self._refill()

    def _refill(self) -> None:
        keys = np.asarray(jax.random.split(self._rng, self.CHUNK + 1))  # [CHUNK + 1, 2] uint32
        self._keys, self._rng, self._next = keys[:-1], keys[-1], 0

    def next(self) -> np.ndarray:
        if self._next == len(self._keys):
            self._refill()
        self._next += 1
        return self._keys[self._next - 1]


def _order_keys(z: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (the radix-sort key: negative floats with every bit flipped,
    the rest with the sign bit set). -inf is the lowest key; NaN does not occur in filtered logits."""
    bits = jax.lax.bitcast_convert_type(z.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_key(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_cut(z: jax.Array, enough) -> jax.Array:
    """Per row of z [..., vocab], the largest logit v such that `enough(z >= v)` (a test of the kept set,
    monotone: true for a superset of a set it is true for). [..., 1]; the row's minimum (everything
    kept) when the test fails even there (a top-p just under 1 above the float32 total, say).

    A bisection on the floats' bit order: 32 halvings of the key range, each one pass over the row,
    instead of a full sort (16 rows of a 49k vocabulary: ~135 ms to sort on 2 CPU cores). The answer
    is a logit of the row, as a sort would give it: the kept set only changes at a logit's value."""
    keys = _order_keys(z)  # [..., vocab]
    lo, hi = keys.min(axis=-1), keys.max(axis=-1)  # enough(everything) holds at lo; the answer is in [lo, hi]

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo + 1) // 2  # the upper middle: lo < mid <= hi while lo < hi
        ok = enough(keys >= mid[..., None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return _from_key(lo)[..., None]


def _kth_largest(z: jax.Array, k: jax.Array) -> jax.Array:
    """The k-th largest logit of each row (ties counted), [..., 1]."""
    return _largest_cut(z, lambda kept: kept.sum(axis=-1) >= k)


def _nucleus_cut(z: jax.Array, top_p: jax.Array) -> jax.Array:
    """The top-p threshold of each row, [..., 1]: the largest logit v whose set {z >= v} holds mass
    >= top_p under softmax(z) (the last value of the smallest sorted prefix reaching top_p)."""
    probs = jnp.exp(z - jax.nn.logsumexp(z, axis=-1, keepdims=True))
    return _largest_cut(z, lambda kept: jnp.sum(jnp.where(kept, probs, 0.0), axis=-1) >= top_p)


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
    some row (top-k > PREFILTER, or a nucleus wider than PREFILTER tokens) the batch finds them by
    bisection over the whole vocabulary (`_largest_cut`), never by a full sort.
    """
    z = logits.astype(jnp.float32) / s.temperature
    vocab = z.shape[-1]
    top = jax.lax.top_k(z, min(PREFILTER, vocab))[0]  # [..., n] descending
    k = s.top_k
    use_k = (k > 0) & (k < vocab)
    kth = jnp.take(top, jnp.clip(k - 1, 0, top.shape[-1] - 1), axis=-1)[..., None]  # within the prefilter
    cut = jax.lax.cond(use_k & (k > top.shape[-1]), lambda: _kth_largest(z, k), lambda: kth)
    z = jnp.where(use_k & (z < cut), -jnp.inf, z)
    top = jnp.where(use_k & (top < cut), -jnp.inf, top)
    threshold, covered = _nucleus(top, z, s.top_p)
    wider = (s.top_p < 1.0) & jnp.any(covered < s.top_p)  # some nucleus reaches past the prefilter
    # Only the rows whose nucleus is wider take the bisection's cut: a row's kept set never depends on
    # its batch (the two sum the same masses in another order, which can move a cut at a rounding tie).
    threshold = jax.lax.cond(wider, lambda: jnp.where((covered < s.top_p)[..., None], _nucleus_cut(z, s.top_p),
                                                      threshold), lambda: threshold)
    return jnp.where((s.top_p < 1.0) & (z < threshold), -jnp.inf, z)


def argmax(logits: jax.Array, chunk: int = ARGMAX_CHUNK) -> jax.Array:
    """`jnp.argmax(logits, axis=-1)` as int32 (the first index of the largest logit), in two passes.

    XLA:CPU runs a one-pass argmax as a scalar (value, index) reduction over the whole vocabulary:
    7.1 ms for 16 rows of SmolLM2's 49,152 logits where the logits themselves cost 5.8 (measured,
    2 cores). Here a plain max over blocks of `chunk` logits (vectorised) picks the first block holding
    the row's maximum and the index pass runs over that block only: 5.7 ms, the same answer, ties
    included. (Rows holding NaN may get another index than jnp.argmax's.) [..., vocab] -> [...]
    Off CPU (not measured there yet) it is `jnp.argmax` itself."""
    vocab = logits.shape[-1]
    blocks = vocab // chunk
    if blocks < 2 or jax.default_backend() != "cpu":  # measured on XLA:CPU only; elsewhere the one-pass reduction
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


def sample(logits: jax.Array, s: Sampler) -> jax.Array:
    """One token per row of `logits` `[..., vocab]` -> `[...]` int32: the argmax where `s.temperature`
    is 0, else a draw from the tempered (top-k / top-p filtered) law with `s.key`."""
    if not isinstance(s, Sampler):
        raise TypeError("a step samples with a Sampler (sampling.sampler(key, SamplingConfig(...))), not a bare key")

    def drawn(x):
        # Plain temperature sampling skips the top-k / top-p pass (its prefilter is a top-256 of every row).
        filtered = ((s.top_k > 0) & (s.top_k < x.shape[-1])) | (s.top_p < 1.0)
        z = jax.lax.cond(filtered, lambda y: filter_logits(y, s), lambda y: y.astype(jnp.float32) / s.temperature, x)
        return draw(z, s.key)

    return jax.lax.cond(s.temperature > 0, drawn, argmax, logits)


def _last_positive(x: jax.Array) -> jax.Array:
    """Index of the last entry > 0 along the last axis of x [..., n] (0 if none). [...]"""
    n = x.shape[-1]
    return n - 1 - jnp.argmax(jnp.flip(x, axis=-1) > 0, axis=-1)


def draw(z: jax.Array, key: jax.Array, chunk: int = ARGMAX_CHUNK) -> jax.Array:
    """One token per row of softmax(z) [..., vocab] -> [...] int32, by inverse CDF from one uniform per row.

    A Gumbel-max draw (`jax.random.categorical`) needs a random number per logit: 3.5 ms for 16 rows
    of a 49k vocabulary on 2 CPU cores, 21 ms for 64, where exp and block sums cost 0.2 / 0.6. Here
    the row's mass is summed per block of `chunk` logits, the uniform picks the block by the blocks'
    running sum and the token by the running sum inside that block. Tokens of zero probability (-inf
    logits: outside top-k / top-p) are never drawn, whatever the rounding."""
    lead, vocab = z.shape[:-1], z.shape[-1]
    blocks = -(-vocab // chunk)
    p = jnp.exp(z - z.max(axis=-1, keepdims=True))  # [..., vocab] unnormalised, the largest 1
    p = jnp.pad(p, [(0, 0)] * len(lead) + [(0, blocks * chunk - vocab)]).reshape(lead + (blocks, chunk))
    mass = p.sum(axis=-1)  # [..., blocks]
    cum = jnp.cumsum(mass, axis=-1)
    u = jax.random.uniform(key, lead, jnp.float32) * cum[..., -1]  # [...] in [0, total]
    block = jnp.minimum(jnp.sum(cum <= u[..., None], axis=-1), _last_positive(mass))  # first block passing u
    before = jnp.where(block > 0, jnp.take_along_axis(cum, jnp.maximum(block - 1, 0)[..., None], axis=-1)[..., 0], 0.0)
    inner = jnp.take_along_axis(p, block[..., None, None], axis=-2)[..., 0, :]  # [..., chunk]
    rest = (u - before)[..., None]
    index = jnp.minimum(jnp.sum(jnp.cumsum(inner, axis=-1) <= rest, axis=-1), _last_positive(inner))
    return (block * chunk + index).astype(jnp.int32)
