"""The engine: owns a loaded target, compiles its steps once per shape, runs generation loops.

Compiled executables are kept in a table keyed by the shapes that matter, so the engine knows
exactly how many compilations it did (and benchmarks can assert none happen after warm-up).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bastion_jax import decoding
from bastion_jax.checkpoint import Target
from bastion_jax.modeling.cache import KVCache
from bastion_jax.sampling import SamplingConfig

# CPU backends cannot donate buffers; the warning is noise there.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


class GenerationError(ValueError):
    """A request the engine cannot serve (e.g. prompt longer than the cache)."""


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prefill_bucket(n: int, cache_len: int, minimum: int = 16) -> int:
    return min(max(minimum, next_pow2(n)), cache_len)


@dataclasses.dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    compile_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    compilations: int = 0

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time after compilation (prefill included)."""
        total = self.ttft_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0

    def summary(self) -> str:
        return (f"new tokens {self.new_tokens} | {self.tokens_per_s:.1f} tok/s | "
                f"TTFT {self.ttft_s * 1e3:.0f} ms | steps {self.steps} | "
                f"compile {self.compile_s:.1f}s ({self.compilations} compilations)")


@dataclasses.dataclass
class Result:
    tokens: list[list[int]]  # new tokens per prompt (stop token included if one was produced)
    stats: Stats


class Engine:
    """Autoregressive generation over a `Target`; batched prompts of different lengths."""

    def __init__(self, target: Target, tokenizer=None, *, stop_ids: Sequence[int] | None = None):
        self.target = target
        self.tokenizer = tokenizer
        if stop_ids is None:
            from bastion_jax.text import stop_ids as _stop_ids

            stop_ids = _stop_ids(tokenizer, target.config.eos_token_ids)
        self.stop_ids = frozenset(int(s) for s in stop_ids)
        self._compiled: dict[tuple, Any] = {}
        self.compilations = 0

    # -- compilation -------------------------------------------------------------------------
    def _executable(self, name: str, sampling: SamplingConfig, cache: KVCache, tokens, *args):
        """The compiled step `name` for these shapes, compiling (and counting) it the first time."""
        key = (name, sampling, tokens.shape, cache.batch, cache.max_len)
        exe = self._compiled.get(key)
        if exe is None:
            fn = getattr(decoding, name)
            exe = fn.lower(self.target.state, cache, tokens, *args, graphdef=self.target.graphdef,
                           sampling=sampling).compile()
            self._compiled[key] = exe
            self.compilations += 1
        return exe

    def _run(self, name: str, sampling: SamplingConfig, cache: KVCache, tokens, *args):
        return self._executable(name, sampling, cache, tokens, *args)(self.target.state, cache, tokens, *args)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.create(self.target.config, batch, max_len, self.target.dtype)

    def cache_len_for(self, prompt_lens: Sequence[int], max_new_tokens: int, max_len: int | None) -> int:
        """Cache length for a request: explicit `max_len`, else the need rounded up to 256."""
        longest = max(prompt_lens)
        limit = self.target.config.max_position_embeddings
        if max_len is None:
            if longest >= limit:
                raise GenerationError(
                    f"prompt of {longest} tokens does not fit the model's context of {limit} positions")
            max_len = min(-(-(longest + max_new_tokens) // 256) * 256, limit)
        if longest >= max_len:
            raise GenerationError(
                f"prompt of {longest} tokens is longer than the cache ({max_len} slots); "
                "raise --max-len or shorten the prompt")
        return max_len

    def warmup(self, batch: int, prompt_len: int, cache_len: int, sampling: SamplingConfig) -> float:
        """Compile the prefill bucket and the decode step for these shapes; returns seconds spent."""
        t0 = time.perf_counter()
        cache = jax.eval_shape(lambda: self.new_cache(batch, cache_len))
        lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
        rng = jax.random.PRNGKey(0)
        bucket = prefill_bucket(prompt_len, cache_len)
        self._executable("prefill", sampling, cache, jax.ShapeDtypeStruct((batch, bucket), jnp.int32), lengths, rng)
        self._executable("decode", sampling, cache, jax.ShapeDtypeStruct((batch,), jnp.int32), lengths, rng)
        return time.perf_counter() - t0

    # -- generation --------------------------------------------------------------------------
    def stream(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256,
               sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
               max_len: int | None = None, stats: Stats | None = None) -> Iterator[list[list[int]]]:
        """Yield, after every step, the new tokens of each row (empty for finished rows)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise GenerationError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab = self.target.config.vocab_size
        if any(not 0 <= t < vocab for p in prompts for t in p):
            raise GenerationError(f"prompt token id outside the vocabulary [0, {vocab})")
        stats = stats if stats is not None else Stats()
        batch = len(prompts)
        lens = np.array([len(p) for p in prompts], np.int32)
        cache_len = self.cache_len_for(lens.tolist(), max_new_tokens, max_len)
        before = self.compilations
        stats.compile_s += self.warmup(batch, int(lens.max()), cache_len, sampling)

        t0 = time.perf_counter()
        bucket = prefill_bucket(int(lens.max()), cache_len)
        padded = np.zeros((batch, bucket), np.int32)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = p
        rng = jax.random.PRNGKey(seed)
        rng, sub = jax.random.split(rng)
        cache = self.new_cache(batch, cache_len)
        nxt, cache = self._run("prefill", sampling, cache, jnp.asarray(padded), jnp.asarray(lens), sub)
        cur = np.asarray(nxt)
        stats.ttft_s += time.perf_counter() - t0
        stats.prompt_tokens += int(lens.sum())
        t1 = time.perf_counter()

        lengths = lens.copy()
        done = np.zeros(batch, bool)
        produced = np.zeros(batch, np.int32)
        budget = min(max_new_tokens, cache_len - int(lens.max()) + 1)
        while True:
            step_tokens = [[] if done[i] else [int(cur[i])] for i in range(batch)]
            for i in range(batch):
                if not done[i]:
                    produced[i] += 1
                    stats.new_tokens += 1
                    if int(cur[i]) in self.stop_ids or produced[i] >= budget:
                        done[i] = True
            yield step_tokens
            if done.all():
                break
            rng, sub = jax.random.split(rng)
            nxt, cache = self._run("decode", sampling, cache, jnp.asarray(cur), jnp.asarray(lengths), sub)
            lengths = lengths + (~done).astype(np.int32)
            cur = np.asarray(nxt)
            stats.steps += 1
        stats.decode_s += time.perf_counter() - t1
        stats.compilations += self.compilations - before

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> Result:
        """Run `stream` to the end; returns new tokens per prompt and statistics."""
        stats = Stats()
        out: list[list[int]] = [[] for _ in prompts]
        for step in self.stream(prompts, stats=stats, **kwargs):
            for i, toks in enumerate(step):
                out[i].extend(toks)
        return Result(out, stats)
