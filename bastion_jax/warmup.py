"""Running the compiled steps before a request is timed: calibration (time them, fit the latency
model) and warm-up (run each once).

Why a warm-up: on XLA:CPU an executable's first run costs ~1-2.5 s on top of its time (SmolLM2,
2 cores: one-time set-up of its matmul kernels, per kernel, so a branch or loop body first taken
later pays then; it recurs for every executable, even one loaded from the compilation cache).
Paid inside a request, it held the README's first command to 5 tok/s against 23 steady, with a 2 s
first token, and a benchmark's short warm-up run left bastion's held-chain steps cold until a timed
answer met them. So every executable a request may use runs once on scratch buffers first
(`warm_up`), and the engine remembers which did (`Engine.warm`), per greedy / sampled: each is a
branch of every step (`sampling.sample`), whose first run pays the set-up again.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from bastion_jax.latency import AR, AR_DRAFT, held
from bastion_jax.modeling.attention import PREFILL_TILE
from bastion_jax.sampling import KeyStream, SamplingConfig, sampler
from bastion_jax.tree_decoding import DRAFT, FLUSH, HOLD

if TYPE_CHECKING:
    from bastion_jax.engine import Engine

FLUSH_VARIANT = "flush"  # the root step that flushes, among `tree_variants` (warmed, never priced)
BAR_DELAY_S = 0.5  # a warm-up bar shows only once its warm-up has lasted this long (most requests: none)
# Counts and time so far, no rate or time left: a bar's items take seconds (compiles) to milliseconds.
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


def exe_id(f, sampling: SamplingConfig) -> tuple[int, bool]:
    """Which compiled executable `f` runs (an `executables.Bound` wraps one anew per request), and
    which of its sampling branches (greedy or not): what `Engine.warm` remembers as run once."""
    return id(getattr(f, "exe", f)), sampling.greedy


def forget(warm: set[tuple[int, bool]], exe) -> None:
    """Take a dropped executable (`Executables.make_room`) out of an engine's `warm` set, under both
    sampling branches: its id may come back on another executable."""
    warm.difference_update({(id(exe), True), (id(exe), False)})


def prompt_args(padded: np.ndarray, lens: np.ndarray, seed: int, sampling: SamplingConfig):
    """(rng, (tokens, lengths, sampler)) of a request: the prompts [batch, bucket] and their lengths on
    the device, and the sampler with the request's first key (temperature, top-k and top-p are arrays,
    made once per request: other values compile nothing)."""
    rng, sub = jax.random.split(jax.random.PRNGKey(seed))
    return rng, (jnp.asarray(padded), jnp.asarray(lens), sampler(sub, sampling))


def tree_variants(engine: "Engine", batch: int, cache_len: int, prompt_bucket: int = 16) -> tuple[Callable, dict]:
    """(prefill, {variant: step}) of bastion at these shapes: every bucket's tree step (not bucket 1,
    `Engine.tree_step_buckets`), the root steps (AR, AR_DRAFT, and a flush under FLUSH_VARIANT) and
    the steps verifying a held lookup chain (`held(b)`); the prefill's prompt bucket `prompt_bucket`."""
    exe = engine.executables
    prefill, steps = exe.tree(batch, prompt_bucket, cache_len, engine.tree_step_buckets("bastion"))
    variants: dict = dict(steps)
    if engine.drafter is not None:
        roots = exe.roots(batch, cache_len)
        variants[AR], variants[AR_DRAFT], variants[FLUSH_VARIANT] = roots[HOLD], roots[DRAFT], roots[FLUSH]
        variants.update({held(b): step for b, step in exe.chains(batch, cache_len).items()})
    return prefill, variants


# Timings per calibrated point. Six back-to-back calibrations on a quiet 2-core CPU put the price of
# a bucket-8 step at 1.73-1.98 AR steps with 5 (the gate's decisions turn on such ratios, and one run
# of four held 623 of ~830 chat steps after its fit, `benchmarks/results/cpu-smollm2-bucket2-ab-2026-12-06.md`),
# and at 1.80-1.89 with 15, for ~9 s more per calibration (the CLI calibrates once per setting).
CALIBRATION_REPS = 15


def calibrate(engine: "Engine", cache_len: int, sampling: SamplingConfig, contexts: Sequence[int] | None,
              reps: int, batch: int, prompt_bucket: int = 16, progress: bool = False
              ) -> list[tuple[int | str, int, float]]:
    """`Engine.calibrate`: the median of `reps` timings of every priced variant (`tree_variants` less
    the flush) at each context, taken in rounds over all points (one timing is off by 10-20% now and
    then on a busy CPU, and the draft gate decides on these prices), fitted into the engine's
    latency model. Steps run with the rows inactive, so the context length stays put. The state
    comes from a prefill at `prompt_bucket`: the request's own bucket, its prefill then compiled
    here once rather than again in its warm-up (~10 s of a first CPU run). `progress`: a bar on
    stderr, a step at a time as each is compiled and first run, then a round at a time (a first
    calibration on a 2-core CPU is minutes of compiling, silent otherwise)."""
    engine.latency = engine.latency.for_batch(batch)
    top = cache_len - engine.tree_slack() - 1
    contexts = sorted({max(1, c) for c in (contexts or (16, top)) if c <= top})
    exe = engine.executables
    prefill, variants = tree_variants(engine, batch, cache_len, prompt_bucket)
    variants.pop(FLUSH_VARIANT, None)
    bar = _bar("latency calibration", progress, "compiling", total=1 + len(variants) + reps)  # prefill, steps, rounds
    key = sampler(jax.random.PRNGKey(0), sampling)
    state, _ = prefill(exe.target_params, exe.drafter_params, exe.new_cache(batch, cache_len),
                       exe.new_drafter_cache(batch, cache_len), jnp.zeros((batch, prompt_bucket), jnp.int32),
                       jnp.ones((batch,), jnp.int32), key)
    bar.update()
    inactive = jnp.zeros((batch,), bool)
    points = [(b, c) for b in variants for c in contexts]
    times: dict[tuple, list[float]] = {pt: [] for pt in points}
    # Rounds over every point rather than each point's runs back to back: a slow spell of the machine
    # then lands on all buckets alike instead of pricing one of them high (four back-to-back
    # calibrations priced bucket 8 at 36.0-42.7 ms, once below bucket 4, which decides buckets).
    state = first_runs(list(variants.values()), state,
                       lambda f, s: f(exe.target_params, exe.drafter_params, s, inactive, key), bar.update)
    engine.warm.update(exe_id(f, sampling) for f in variants.values())
    bar.set_postfix_str("timing")
    for _ in range(reps):
        for b, c in points:
            state = state.replace(length=jnp.full((batch,), c, jnp.int32))
            t0 = time.perf_counter()
            state, out, _ = variants[b](exe.target_params, exe.drafter_params, state, inactive, key)
            jax.block_until_ready(out.count)
            times[(b, c)].append(time.perf_counter() - t0)
        bar.update()
    bar.close()
    samples = [(b, c, statistics.median(times[(b, c)])) for b, c in points]
    engine.latency.fit(samples)
    return samples


def first_runs(steps: Sequence[Callable], state, call: Callable, done: Callable[[], object] | None = None):
    """Run every step once, `call(step, state) -> (state, ...)`, on scratch state (a step donates it),
    outputs dropped, `done()` after each when given (a progress bar's tick); returns a state to go
    on with, computed: whatever the warm-up left running (a first run's set-up, ~1 s) would
    otherwise delay the request's first op and count in its time to first token (0.94 s against
    0.155 s at a new prompt bucket, before this waited).

    On XLA:CPU an executable's first run is mostly one-off set-up on the calling thread (~1 s per
    SmolLM2 tree step), so there two steps at a time run, each on its own copy of the state, beside
    the loads and compiles still going on (`Executables.compiled`): the warm-up of a warm bastion
    request's 12 steps 15-16 -> 10-11 s on 2 cores. Elsewhere one after the other, the state passed
    on: nothing to gain there, and each copy of the caches would cost device memory."""
    if jax.default_backend() != "cpu":
        for step in steps:
            state = call(step, state)[0]
            if done:  # (counted once it has run)
                jax.block_until_ready(state)
                done()
        return jax.block_until_ready(state)

    def one(step):
        jax.block_until_ready(call(step, jax.tree.map(jnp.copy, state)))
        if done:
            done()

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(one, steps))  # (re-raises a step's error)
    return jax.block_until_ready(state)


def _bar(desc: str, show: bool, phase: str, **kwargs) -> tqdm:
    """A progress bar on stderr (disabled unless `show`), cleared when closed, `phase` after the counts."""
    return tqdm(desc=desc, disable=not show, file=sys.stderr, dynamic_ncols=True, leave=False, postfix=phase,
                bar_format=BAR_FORMAT, **kwargs)


@contextlib.contextmanager
def progress(engine: "Engine") -> Iterator[tqdm]:
    """A request's preparation with its warm-up bar on stderr (disabled unless `engine.progress`):
    each step lowered counts (`Executables.on_lower`), then `warm_up(..., bar)` counts the first
    runs. Without it a CLI run sits silent for the seconds (CPU) its steps take to lower, compile or
    load, and run once."""
    bar = _bar("warm-up", engine.progress, "lowering", delay=BAR_DELAY_S)
    engine.executables.on_lower = bar.update
    try:
        yield bar
    finally:
        engine.executables.on_lower = None
        bar.close()


def warm_up(engine: "Engine", kind: str, batch: int, bucket: int, cache_len: int, sampling: SamplingConfig,
            prefill, steps: Sequence, bar: tqdm) -> None:
    """Run once, on scratch buffers, the prefill and every step of a request of policy `kind` ("ar",
    "dflash" or a tree policy) that never ran (nothing when all did). Steps run with their rows
    inactive, at a context of 16 (272 after a prompt bucket over one prefill tile), so that the
    attention's loops run, and their outputs are dropped. `bar` (`progress`'s) counts the runs."""
    steps = [f for f in steps if exe_id(f, sampling) not in engine.warm]
    if not steps and exe_id(prefill, sampling) in engine.warm:
        return
    exe = engine.executables
    bar.set_postfix_str("first runs", refresh=False)
    bar.reset(total=1 + len(steps))  # the prefill, then every step: compiled (or loaded) and run once
    # A prompt over one prefill tile, where the bucket has two: the tiled prefill's loop over the key
    # tiles left of the diagonal runs then (a loop body first run inside the request costs ~0.35 s of
    # a 1,377-token prompt's prefill on CPU), while the padding tiles stay skipped (cheap).
    warm_len = PREFILL_TILE + 16 if bucket > PREFILL_TILE else 16
    # The request's own host->device preparation too, on dummy prompts of the same shapes: its eager
    # ops (the key split, the prompt's transfer, a sampled request's per-step keys) compile on their
    # first use, ~0.1-0.2 s of the first request's time to first token otherwise.
    rng, (tokens, lens, params) = prompt_args(np.zeros((batch, bucket), np.int32),
                                              np.full((batch,), min(warm_len, bucket), np.int32), 0, sampling)
    if not sampling.greedy:
        KeyStream(rng)
    inactive = jax.device_put(np.zeros((batch,), bool))
    if kind == "ar":
        tcache, nxt = prefill(exe.target_params, exe.new_cache(batch, cache_len), tokens, lens, params)
        bar.update()
        for step in steps:  # (the loop sends the lengths each step)
            tcache, nxt = step(exe.target_params, tcache, nxt, jax.device_put(np.asarray(lens)), params, inactive)
            bar.update()
        jax.block_until_ready(nxt)
    elif kind == "dflash":
        state = prefill(exe.target_params, exe.drafter_params, exe.new_cache(batch, cache_len),
                        exe.new_drafter_cache(batch, cache_len), tokens, lens, params)
        bar.update()
        for step in steps:
            state, _ = step(exe.target_params, exe.drafter_params, state, inactive, params)
            bar.update()
        jax.block_until_ready(state)
    else:
        state, _ = prefill(exe.target_params, exe.drafter_params, exe.new_cache(batch, cache_len),
                           exe.new_drafter_cache(batch, cache_len), tokens, lens, params)
        bar.update()
        first_runs(steps, state, lambda f, s: f(exe.target_params, exe.drafter_params, s, inactive, params),
                   bar.update)
    engine.warm.update(exe_id(f, sampling) for f in (prefill, *steps))  # (the prefill ran too: it made the state)
