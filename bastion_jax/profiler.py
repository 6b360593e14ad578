"""The step profiler as a library: `run_profile(engine, contexts, cache_len)` times, for every bucket b
and context c (the committed length the step starts from):

  step     the engine's compiled tree step, dispatched and synchronised (what T_hat(b, c) predicts)
  device   the same step dispatched back to back and synchronised once: device time per step
  verify   the target forward over the b-node tree at c (tree mask, taps) + argmax at every node
  forward  a plain causal forward of b tokens at c (no tree mask, no taps): verify's yardstick
  draft    the drafter's block forward + tree build (depends on c only)
  host     one iteration of the engine's decode loop (controller choice, dispatch, one device->host
           read, online calibration) minus the device time of the step it runs: what the host adds
           per step, for the loop each policy runs at b. bastion: the controller's choice, then the
           tree step (read before the next choice); at b = 1 bastion takes root steps instead, which
           it dispatches one ahead while they hold. fixed:b: its tree steps dispatched one ahead.

plus the plain AR decode step per context, and fits the engine's latency model to the step times.
All executables are compiled before timing; the run counts compilations during timing (must be 0).
`python -m bastion_jax.profile` is the CLI over it; `profile_report` writes what it measured.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import sys
import time
from typing import Callable, Sequence

import numpy as np

ROUNDS = 5  # alternating rounds of device-time and host-loop timing per cell
HOST_REPS = 10  # steps per round at least: the host's share is a difference of two timings, a few % apart


@dataclasses.dataclass(frozen=True)
class Point:
    """Medians of one (bucket, context) cell, in seconds."""

    bucket: int
    context: int
    step_s: float  # full tree step, synchronised
    device_s: float  # full tree step, back-to-back dispatch (device time)
    verify_s: float  # target forward over the tree + argmax
    forward_s: float  # a plain causal forward of as many tokens (no tree, no taps): verify's yardstick
    draft_s: float  # drafter block + tree build (per context)
    loop_s: float  # one iteration of the engine's host loop under bastion at b (b = 1: root steps)
    loop_device_s: float  # device time of the step that loop runs (device_s, or the root step's at b = 1)
    host_s: float  # loop_s - loop_device_s
    fixed_loop_s: float  # one iteration of the fixed:b loop (each tree step dispatched before the last is read)
    fixed_host_s: float  # fixed_loop_s - device_s
    host_cpu_s: float = math.nan  # the host thread's own CPU time per bastion loop iteration (see _loop_time)
    call_cpu_s: float = math.nan  # of which inside the compiled step's call (arguments, XLA's launch)
    roofline_s: float = math.nan  # LatencyModel.raw with the run's peaks
    calibrated_s: float = math.nan  # LatencyModel.predict after the fit


@dataclasses.dataclass
class Profile:
    points: list[Point]
    ar_step_s: dict[int, float]  # context -> plain AR decode step
    cache_len: int
    compile_s: float
    compilations_during_timing: int

    @property
    def calibration_error(self) -> float:
        """RMSE of the calibrated prediction over all cells / mean measured step time."""
        err = [(p.calibrated_s - p.step_s) ** 2 for p in self.points]
        return math.sqrt(sum(err) / len(err)) / statistics.fmean(p.step_s for p in self.points)


# -- measurement ------------------------------------------------------------------------------------

def median_s(run: Callable[[], object], reps: int, warmup: int) -> float:
    """Median wall time of `run` (which must synchronise), after `warmup` untimed calls."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_profile(engine, contexts: Sequence[int], cache_len: int, *, reps: int = 5, warmup: int = 2,
                progress: bool = True) -> Profile:
    """Time every (bucket, context) cell of `engine` (which needs a drafter and batch 1), then fit
    `engine.latency` to the step times. The latency model's peaks are used as they are."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from bastion_jax import compile_counter
    from bastion_jax.controller import Controller, Policy
    from bastion_jax.latency import AR, AR_DRAFT, held
    from bastion_jax.draft_gate import DraftGate
    from bastion_jax.tree_decoding import DRAFT, HOLD, pending_slots
    from bastion_jax.tree_loop import TreeLoop
    from bastion_jax.sampling import SamplingConfig, sampler

    buckets = engine.buckets
    sampling = SamplingConfig()
    compile_counter.compilations()  # start listening before anything compiles
    bar = tqdm(total=len(contexts) * (len(buckets) + 1) + 1, desc="profile", unit="cell", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    bar.set_postfix_str("compiling")
    t0 = time.perf_counter()
    exe = engine.executables
    prefill, steps = exe.tree(1, 16, cache_len, buckets)
    roots = exe.roots(1, cache_len) if engine.drafter is not None else {}
    # The steps verifying a held lookup chain (no draft after them): timed as `held(b)` variants.
    chains = exe.chains(1, cache_len) if engine.drafter is not None else {}
    verify, draft = exe.tree_parts(1, cache_len, buckets)
    plain = {b: exe.forward(1, cache_len, b) for b in buckets}
    plain_tokens = {b: jax.device_put(np.zeros((1, b), np.int32)) for b in buckets}
    _, ar_step = exe.ar(1, 16, cache_len)
    exe.ready()
    compile_s = time.perf_counter() - t0
    bar.update()

    tstate, dstate = exe.target_params, exe.drafter_params
    key = sampler(jax.random.PRNGKey(0), sampling)
    state, curve = prefill(tstate, dstate, exe.new_cache(1, cache_len), exe.new_drafter_cache(1, cache_len),
                           jnp.zeros((1, 16), jnp.int32), jnp.ones((1,), jnp.int32), key)
    ar_cache = exe.new_cache(1, cache_len)
    features = jnp.zeros(exe.feature_shape(1), exe.feature_dtype)  # [1, block, taps * hidden]
    zero_tok = jax.device_put(np.zeros(1, np.int32))
    active = jax.device_put(np.ones(1, bool))  # the AR step writes its K/V, as when decoding
    inactive = jax.device_put(np.zeros(1, bool))  # rows stay put: every rep runs at the same context
    loop_latency = copy.deepcopy(engine.latency)  # the host loop's online updates must not touch the fit
    controller = Controller(Policy("bastion"), buckets, loop_latency)
    gate = DraftGate(buckets, loop_latency.step_time, pending_slots(engine.block_size), engine.block_size)
    rng = jax.random.PRNGKey(1)

    compiled_before = compile_counter.compilations()
    cells: list[dict] = []
    root_samples: list[tuple[str, int, float]] = []
    ar_step_s: dict[int, float] = {}
    for c in contexts:
        bar.set_postfix_str(f"context {c}: AR + draft")
        length = jax.device_put(np.full(1, c, np.int32))
        ctx_start = jax.device_put(np.full(1, c - 1, np.int32))  # one committed token injected, root at c
        one = jax.device_put(np.ones(1, np.int32))
        # The steps donate their state, so the state gets its own copy of the length.
        box = {"ar": ar_cache, "state": state.replace(length=jax.device_put(np.full(1, c, np.int32))),
               "curve": curve}

        def ar():
            box["ar"], nxt = ar_step(tstate, box["ar"], zero_tok, length, key, active)
            jax.block_until_ready(nxt)

        def drafting():
            s = box["state"]
            dcache, tree, _ = draft(tstate, dstate, s.drafter_cache, features, ctx_start, one, zero_tok)
            box["state"] = s.replace(drafter_cache=dcache)
            jax.block_until_ready(tree.tokens)

        ar_step_s[c] = median_s(ar, reps, warmup)
        draft_s = median_s(drafting, reps, warmup)
        for then, variant in ((HOLD, AR), (DRAFT, AR_DRAFT)):  # the root (AR) step, as the draft gate prices it
            if then in roots:
                def root_step(root=roots[then]):
                    box["state"], out, _ = root(tstate, dstate, box["state"], inactive, key)
                    jax.block_until_ready(out.count)

                root_samples.append((variant, c, median_s(root_step, reps, warmup)))
        for b, chain in chains.items():  # (priced by the gate as T(b, c, no draft))
            def chain_step(chain=chain):
                box["state"], out, _ = chain(tstate, dstate, box["state"], inactive, key)
                jax.block_until_ready(out.count)

            root_samples.append((held(b), c, median_s(chain_step, reps, warmup)))
        bar.update()
        for b in buckets:
            bar.set_postfix_str(f"bucket {b} context {c}")
            step = steps[b]

            def full():
                box["state"], out, box["curve"] = step(tstate, dstate, box["state"], inactive, key)
                jax.block_until_ready(out.count)

            def verifying():
                s = box["state"]
                tcache, choices = verify[b](tstate, s.target_cache, s.tree, length)
                box["state"] = s.replace(target_cache=tcache)
                jax.block_until_ready(choices)

            def forwarding(fwd=plain[b], b=b):
                s = box["state"]
                tcache, toks = fwd(tstate, s.target_cache, plain_tokens[b], length)
                box["state"] = s.replace(target_cache=tcache)
                jax.block_until_ready(toks)

            step_s = median_s(full, reps, warmup)
            verify_s = median_s(verifying, reps, warmup)
            forward_s = median_s(forwarding, reps, warmup)
            # Host overhead is a difference of two timings, so both are taken in alternating rounds
            # (a slow spell of the machine hits both) and the median round is kept.
            # bastion's own choice at b = 1 is a root step (it never verifies a 1-node tree).
            root = roots.get(HOLD) if b == 1 else None
            bastion, call_cpu = _bastion_loop(steps, roots, controller, gate, b, tstate, dstate, box["curve"])
            fixed = TreeLoop("fixed", Controller(Policy("fixed", b), buckets, loop_latency), None, steps, None,
                             loop_latency, buckets, tstate, dstate, box["curve"])
            rounds: dict[str, list[float]] = {"device": [], "loop_device": [], "loop": [], "fixed_loop": [],
                                              "host_cpu": [], "call_cpu": []}
            n = max(reps, HOST_REPS)
            for r in range(ROUNDS):
                w = warmup if r == 0 else 0
                rounds["device"].append(_device_time(full, step, tstate, dstate, box, inactive, key, n, w))
                rounds["loop_device"].append(
                    _device_time(None, root, tstate, dstate, box, inactive, key, n, w) if root else math.nan)
                loop_s, cpu_s, call_s = _loop_time(bastion, box, c, rng, n, w, ahead=root is not None,
                                                   spent=call_cpu)
                rounds["loop"].append(loop_s)
                rounds["host_cpu"].append(cpu_s)
                rounds["call_cpu"].append(call_s)
                rounds["fixed_loop"].append(_loop_time(fixed, box, c, rng, n, w, ahead=True)[0])
            med = {k: statistics.median(v) for k, v in rounds.items()}
            loop_device_s = med["loop_device"] if root else med["device"]
            cells.append(dict(bucket=b, context=c, step_s=step_s, device_s=med["device"], verify_s=verify_s,
                              forward_s=forward_s, draft_s=draft_s, loop_s=med["loop"], loop_device_s=loop_device_s,
                              host_s=med["loop"] - loop_device_s, fixed_loop_s=med["fixed_loop"],
                              fixed_host_s=med["fixed_loop"] - med["device"], host_cpu_s=med["host_cpu"],
                              call_cpu_s=med["call_cpu"]))
            bar.update()
        ar_cache, state, curve = box["ar"], box["state"], box["curve"]
    compilations = compile_counter.compilations() - compiled_before
    bar.close()

    engine.latency.fit([(p["bucket"], p["context"], p["step_s"]) for p in cells] + root_samples)
    points = [Point(**p, roofline_s=engine.latency.raw(p["bucket"], p["context"]),
                    calibrated_s=engine.latency.predict(p["bucket"], p["context"])) for p in cells]
    return Profile(points, ar_step_s, cache_len, compile_s, compilations)


def _device_time(full, step, tstate, dstate, box: dict, inactive, key, reps: int, warmup: int) -> float:
    """Seconds per step with `reps` steps dispatched back to back and one synchronisation at the end:
    the host runs ahead, so this is the device's time per step. `full` (or `step` itself, when None)
    warms up."""
    import jax

    for _ in range(warmup):
        if full is not None:
            full()
        else:
            box["state"], out, _ = step(tstate, dstate, box["state"], inactive, key)
            jax.block_until_ready(out.count)
    t0 = time.perf_counter()
    for _ in range(reps):
        box["state"], out, curve = step(tstate, dstate, box["state"], inactive, key)
    jax.block_until_ready((box["state"], out, curve))
    return (time.perf_counter() - t0) / reps


class _Pinned:
    """The bastion controller with its choice computed (its cost is part of the host's) and then
    replaced by one bucket, so the loop times that bucket's step."""

    def __init__(self, controller, bucket: int):
        self.controller, self.bucket, self.histogram = controller, bucket, controller.histogram

    def choose(self, *args, **kwargs) -> int:
        self.controller.choose(*args, **kwargs)
        return self.bucket


class _Holding:
    """A draft gate whose every decision is computed (its cost is the host's) and then replaced by
    "hold": the loop runs root steps that do not draft, as bastion does when drafting does not pay."""

    def __init__(self, gate):
        self.gate = gate
        self.chained = 0  # (no held step in the profiler's loop: no chain is ever verified)

    def use_tree(self, context: int, curve=None) -> bool:
        self.gate.use_tree(context, curve)
        return False

    def root_then(self, context: int, hint=None) -> int:
        from bastion_jax.tree_decoding import HOLD

        self.gate.root_then(context, hint)
        return HOLD

    def record(self, then: int, committed: int) -> None:
        self.gate.record(then, committed)

    def observe_verify(self, *args) -> None:
        pass

    def observe_tree(self, curve) -> None:
        self.gate.observe_tree(curve)


class _CallCpu:
    """A step whose calls add the calling thread's CPU time to `spent[0]`: what the compiled call
    itself costs the host (its arguments, and XLA's per-execution work on the calling thread, which
    grows with the program's kernel count), apart from the loop's own Python and read."""

    def __init__(self, step, spent: list):
        self.step, self.spent = step, spent

    def __call__(self, *args):
        c0 = time.thread_time()
        try:
            return self.step(*args)
        finally:
            self.spent[0] += time.thread_time() - c0


def _bastion_loop(steps: dict, roots: dict, controller, gate, b: int, tstate, dstate, curve):
    """The engine's tree loop (`TreeLoop`) as bastion runs it at bucket b: b > 1 (or no root steps) the
    controller's choice, computed and then pinned to b; b = 1 root steps that hold, under a gate whose
    decisions are computed and then pinned to "hold". Returns (loop, [seconds]): its steps add their
    calls' CPU time to the list's one entry (`_CallCpu`)."""
    from bastion_jax.tree_loop import TreeLoop

    spent = [0.0]
    gate = _Holding(gate) if b == 1 and roots else None
    loop = TreeLoop("bastion", _Pinned(controller, b), gate, {k: _CallCpu(f, spent) for k, f in steps.items()},
                    {k: _CallCpu(f, spent) for k, f in roots.items()} or None, controller.latency,
                    controller.buckets, tstate, dstate, curve)
    return loop, spent


def _loop_time(loop, box: dict, c: int, rng, reps: int, warmup: int, ahead: bool,
               spent: list | None = None) -> tuple[float, float, float]:
    """Seconds per iteration of the engine's own tree loop (`TreeLoop.step`, greedy), `ahead`: with the
    next step dispatched before this one is read where the loop's policy does so: dispatch, one
    device->host read of tokens, counts and curve, the online latency update, plus the engine's
    per-row slicing of the tokens. As in the engine, a greedy step reuses its key. The device-side
    active mask is all False, so every iteration runs at context c.

    Returns (seconds, host CPU seconds, call CPU seconds) per iteration. The second is the loop
    thread's own CPU time (`time.thread_time`: its Python, the dispatch with XLA's per-execution work
    on the calling thread, the read's copy; the step itself runs on XLA's threads and a blocked read
    costs none): a direct measure of the host's work, where the first minus the device time is a
    difference of two timings a few % apart. Where nothing goes ahead of the read (bastion's tree
    steps), the device is idle for exactly that time. The third is the part of the second spent inside
    the compiled steps' calls, from `spent` (`_bastion_loop`'s count; NaN without one)."""
    import jax

    from bastion_jax.sampling import SamplingConfig, sampler

    active, active_dev = np.ones(1, bool), jax.device_put(np.zeros(1, bool))
    params = sampler(rng, SamplingConfig())  # as the engine: made once per request
    t0 = c0 = 0.0
    for i in range(warmup + reps):
        if i == warmup:
            t0, c0 = time.perf_counter(), time.thread_time()
            if spent is not None:
                spent[0] = 0.0
        box["state"], toks, counts = loop.step(box["state"], active, active_dev, np.full(1, c), lambda: params,
                                               look_ahead=ahead, tree_ahead=ahead)
        _ = [toks[r, : counts[r]] for r in range(toks.shape[0])]
    elapsed, cpu = (time.perf_counter() - t0) / reps, (time.thread_time() - c0) / reps
    call = spent[0] / reps if spent is not None else math.nan
    if loop.queued is not None:  # the step dispatched past the last read: its state is the box's already
        jax.block_until_ready(loop.queued[2].count)
        loop.queued = None
    return elapsed, cpu, call
