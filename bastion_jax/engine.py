"""The engine: owns a loaded target (and drafter), compiles its steps once per shape, runs loops.

Compiled executables are kept in a table keyed by the shapes that matter, so the engine knows
exactly how many compilations it did (and tests can assert none happen after warm-up).

Modes: "ar" (one token per step) and "dflash" (chain speculative decoding: draft a block,
verify it in one target forward). Both share prompt handling, stop rules and statistics.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bastion_jax import decoding, speculative
from bastion_jax.checkpoint import LoadedDrafter, Target
from bastion_jax.modeling.cache import KVCache
from bastion_jax.sampling import SamplingConfig

# CPU backends cannot donate buffers; the warning is noise there.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

MODES = ("ar", "dflash")


class GenerationError(ValueError):
    """A request the engine cannot serve (e.g. prompt longer than the cache)."""


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prefill_bucket(n: int, cache_len: int, minimum: int = 16) -> int:
    return min(max(minimum, next_pow2(n)), cache_len)


@dataclasses.dataclass
class Stats:
    mode: str = "ar"
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # decoding steps after prefill
    committed: int = 0  # tokens committed by those steps, summed over rows (accepted + 1 each)
    row_steps: int = 0  # (row, step) pairs in which the row was active
    compile_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    compilations: int = 0

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time after compilation (prefill included)."""
        total = self.ttft_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens committed per row per step (accepted + 1); 1.0 for AR."""
        return self.committed / self.row_steps if self.row_steps else 0.0

    def summary(self) -> str:
        return (f"new tokens {self.new_tokens} | {self.tokens_per_s:.1f} tok/s | tau {self.tau:.2f} | "
                f"TTFT {self.ttft_s * 1e3:.0f} ms | steps {self.steps} | "
                f"compile {self.compile_s:.1f}s ({self.compilations} compilations)")


@dataclasses.dataclass
class Result:
    tokens: list[list[int]]  # new tokens per prompt (stop token included if one was produced)
    stats: Stats


class _Rows:
    """Host-side per-row bookkeeping: budget, stop ids, what each row has emitted."""

    def __init__(self, batch: int, budget: int, stop_ids: frozenset[int]):
        self.done = np.zeros(batch, bool)
        self.produced = np.zeros(batch, np.int64)
        self.budget = budget
        self.stop_ids = stop_ids

    def take(self, i: int, tokens: Sequence[int]) -> list[int]:
        """Keep what row i may still emit: up to its budget, through its first stop id."""
        if self.done[i]:
            return []
        out = []
        for t in tokens:
            out.append(int(t))
            self.produced[i] += 1
            if int(t) in self.stop_ids or self.produced[i] >= self.budget:
                self.done[i] = True
                break
        return out


class Engine:
    """Generation over a `Target`, optionally with a DFlash drafter; batches of any prompt lengths.

    `proposal` (dflash mode) replaces or edits the drafter's per-position logits inside the jitted
    step; with no drafter it is the only source of drafts (`block_size` must then be given).
    """

    def __init__(self, target: Target, tokenizer=None, *, drafter: LoadedDrafter | None = None,
                 stop_ids: Sequence[int] | None = None, proposal: Callable | None = None,
                 block_size: int | None = None, mask_token_id: int = 0):
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.proposal = proposal
        if drafter is not None:
            drafter.config.check_pair(target.config)
            block_size = drafter.config.block_size
            mask_token_id = drafter.config.mask_token_id
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        if stop_ids is None:
            from bastion_jax.text import stop_ids as _stop_ids

            stop_ids = _stop_ids(tokenizer, target.config.eos_token_ids)
        self.stop_ids = frozenset(int(s) for s in stop_ids)
        self._compiled: dict[tuple, Any] = {}
        self.compilations = 0

    @property
    def default_mode(self) -> str:
        return "dflash" if self.block_size else "ar"

    # -- compilation -------------------------------------------------------------------------
    def _executable(self, fn, key: tuple, args: tuple, static: dict):
        """The compiled `fn` for `key`, compiling (and counting) it the first time."""
        exe = self._compiled.get(key)
        if exe is None:
            exe = fn.lower(*args, **static).compile()
            self._compiled[key] = exe
            self.compilations += 1
        return exe

    def _spec_static(self, sampling: SamplingConfig) -> dict:
        d = self.drafter
        return dict(target_def=self.target.graphdef, drafter_def=d.graphdef if d else None,
                    sampling=sampling, block_size=self.block_size, mask_token_id=self.mask_token_id,
                    tap_layers=tuple(d.config.target_layer_ids) if d else (), proposal=self.proposal)

    def _step_fns(self, mode: str, batch: int, bucket: int, cache_len: int, sampling: SamplingConfig):
        """(prefill, step) executables for these shapes; both compiled now if not yet."""
        i32 = jnp.int32
        lengths = jax.ShapeDtypeStruct((batch,), i32)
        rng = jax.random.PRNGKey(0)
        tokens = jax.ShapeDtypeStruct((batch, bucket), i32)
        tcache = jax.eval_shape(lambda: self.new_cache(batch, cache_len))
        shape_key = (mode, sampling, batch, bucket, cache_len)
        if mode == "ar":
            static = dict(graphdef=self.target.graphdef, sampling=sampling)
            prefill = self._executable(decoding.prefill, ("prefill",) + shape_key,
                                       (self.target.state, tcache, tokens, lengths, rng), static)
            step = self._executable(decoding.decode, ("decode",) + shape_key[:3] + shape_key[4:],
                                    (self.target.state, tcache, jax.ShapeDtypeStruct((batch,), i32), lengths, rng),
                                    static)
            return prefill, step
        static = self._spec_static(sampling)
        dstate = self.drafter.state if self.drafter else None
        dcache = jax.eval_shape(lambda: self.new_drafter_cache(batch, cache_len))
        prefill = self._executable(speculative.spec_prefill, ("spec_prefill",) + shape_key,
                                   (self.target.state, dstate, tcache, dcache, tokens, lengths, rng), static)
        state = jax.eval_shape(lambda: speculative.SpecState(
            tcache, dcache, jnp.zeros((batch,), i32), jnp.zeros((batch, self.block_size - 1), i32),
            jnp.zeros((batch,), i32)))
        step = self._executable(speculative.spec_step, ("spec_step",) + shape_key[:3] + shape_key[4:],
                                (self.target.state, dstate, state, jax.ShapeDtypeStruct((batch,), bool), rng),
                                static)
        return prefill, step

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.create(self.target.config, batch, max_len, self.target.dtype)

    def new_drafter_cache(self, batch: int, max_len: int) -> KVCache:
        if self.drafter is None:
            return KVCache(k=(), v=())
        dtype = self.drafter.state["norm"]["weight"][...].dtype
        return KVCache.create(self.drafter.config, batch, max_len, dtype)

    def cache_len_for(self, prompt_lens: Sequence[int], max_new_tokens: int, max_len: int | None,
                      slack: int = 0) -> int:
        """Cache length: explicit `max_len`, else prompt + new tokens + slack rounded up to 256."""
        longest = max(prompt_lens)
        limit = self.target.config.max_position_embeddings
        if max_len is None:
            if longest + slack >= limit:
                raise GenerationError(
                    f"prompt of {longest} tokens does not fit the model's context of {limit} positions")
            max_len = min(-(-(longest + max_new_tokens + slack) // 256) * 256, limit)
        elif max_len > limit:
            raise GenerationError(f"--max-len {max_len} exceeds the model's context of {limit} positions")
        if longest + slack >= max_len:
            raise GenerationError(
                f"prompt of {longest} tokens is longer than the cache ({max_len} slots"
                + (f", {slack} reserved for verification" if slack else "")
                + "); raise --max-len or shorten the prompt")
        return max_len

    def warmup(self, batch: int, prompt_len: int, cache_len: int, sampling: SamplingConfig,
               mode: str | None = None) -> float:
        """Compile the prefill bucket and the step for these shapes; returns seconds spent."""
        t0 = time.perf_counter()
        self._step_fns(mode or self.default_mode, batch, prefill_bucket(prompt_len, cache_len), cache_len, sampling)
        return time.perf_counter() - t0

    # -- generation --------------------------------------------------------------------------
    def stream(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256,
               sampling: SamplingConfig = SamplingConfig(), seed: int = 0, mode: str | None = None,
               max_len: int | None = None, stats: Stats | None = None) -> Iterator[list[list[int]]]:
        """Yield, after every step, the new tokens of each row (empty for finished rows)."""
        mode = mode or self.default_mode
        if mode not in MODES:
            raise GenerationError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
        if mode == "dflash" and not self.block_size:
            raise GenerationError("mode dflash needs a drafter (--drafter DIR)")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise GenerationError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab = self.target.config.vocab_size
        if any(not 0 <= t < vocab for p in prompts for t in p):
            raise GenerationError(f"prompt token id outside the vocabulary [0, {vocab})")
        stats = stats if stats is not None else Stats()
        stats.mode = mode
        batch = len(prompts)
        lens = np.array([len(p) for p in prompts], np.int32)
        slack = self.block_size if mode == "dflash" else 0
        cache_len = self.cache_len_for(lens.tolist(), max_new_tokens, max_len, slack)
        bucket = prefill_bucket(int(lens.max()), cache_len)
        before = self.compilations
        t0 = time.perf_counter()
        prefill, step = self._step_fns(mode, batch, bucket, cache_len, sampling)
        stats.compile_s += time.perf_counter() - t0

        t0 = time.perf_counter()
        padded = np.zeros((batch, bucket), np.int32)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = p
        rng = jax.random.PRNGKey(seed)
        rng, sub = jax.random.split(rng)
        tcache = self.new_cache(batch, cache_len)
        # Every step writes at most `slack` slots past the committed length, so the budget below
        # keeps all writes inside the cache.
        rows = _Rows(batch, min(max_new_tokens, cache_len - int(lens.max()) - slack + 1), self.stop_ids)
        if mode == "ar":
            nxt, tcache = prefill(self.target.state, tcache, jnp.asarray(padded), jnp.asarray(lens), sub)
            first = np.asarray(nxt)
        else:
            dstate = self.drafter.state if self.drafter else None
            state = prefill(self.target.state, dstate, tcache, self.new_drafter_cache(batch, cache_len),
                            jnp.asarray(padded), jnp.asarray(lens), sub)
            first = np.asarray(state.root)
        stats.ttft_s += time.perf_counter() - t0
        stats.prompt_tokens += int(lens.sum())
        t1 = time.perf_counter()

        emitted = [rows.take(i, [first[i]]) for i in range(batch)]
        stats.new_tokens += sum(map(len, emitted))
        yield emitted
        lengths = lens.copy()
        cur = first
        while not rows.done.all():
            rng, sub = jax.random.split(rng)
            active = ~rows.done
            if mode == "ar":
                nxt, tcache = step(self.target.state, tcache, jnp.asarray(cur), jnp.asarray(lengths), sub)
                lengths = lengths + active.astype(np.int32)
                cur = np.asarray(nxt)
                new = [[cur[i]] for i in range(batch)]
                counts = np.ones(batch, np.int64)
            else:
                state, out = step(self.target.state, dstate, state, jnp.asarray(active), sub)
                toks, counts = np.asarray(out.tokens), np.asarray(out.count)
                new = [toks[i, : counts[i]] for i in range(batch)]
            stats.steps += 1
            stats.row_steps += int(active.sum())
            stats.committed += int(counts[active].sum())
            emitted = [rows.take(i, new[i]) for i in range(batch)]
            stats.new_tokens += sum(map(len, emitted))
            yield emitted
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
