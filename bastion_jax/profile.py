"""`python -m bastion_jax.profile`: per bucket x context timings of the BASTION step, the roofline and
its calibration, written as the controller's calibration JSON + a plot + a markdown table.

    python -m bastion_jax.profile --arch qwen3-8b --contexts 512,2048,4096
    python -m bastion_jax.profile --target DIR --drafter DIR --install
    python -m bastion_jax.profile --arch smollm2-135m --layers 2 --buckets 1,4,8 --contexts 64,128

For every bucket b and context c (the committed length the step starts from):
  step     the engine's compiled tree step, dispatched and synchronised (what T_hat(b, c) predicts)
  device   the same step dispatched back to back and synchronised once: device time per step
  verify   the target forward over the b-node tree at c (tree mask, taps) + argmax at every node
  draft    the drafter's block forward + tree build (depends on c only)
  host     one iteration of the engine's decode loop (controller choice, dispatch, device->host
           reads, online calibration) minus device time: what the host adds per step
plus the plain AR decode step per context, the roofline made with the device's measured copy
bandwidth and matmul rate, and the per-bucket linear calibration fitted to the step times.
All executables are compiled before timing; the run counts compilations during timing (must be 0).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from bastion_jax.cli import fail, stderr_log
from bastion_jax.controller import DEFAULT_BUCKETS, PolicyError, parse_buckets

DEFAULT_CONTEXTS = (128, 512, 2048)
ROUNDS = 3  # alternating rounds of device-time and host-loop timing per cell


class ProfileError(ValueError):
    """Bad profiler input (reported as one `error:` line)."""


@dataclasses.dataclass(frozen=True)
class Point:
    """Medians of one (bucket, context) cell, in seconds."""

    bucket: int
    context: int
    step_s: float  # full tree step, synchronised
    device_s: float  # full tree step, back-to-back dispatch (device time)
    verify_s: float  # target forward over the tree + argmax
    draft_s: float  # drafter block + tree build (per context)
    loop_s: float  # one iteration of the engine's host loop
    host_s: float  # loop_s - device_s
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


# -- input checks -----------------------------------------------------------------------------------

def parse_contexts(text: str) -> tuple[int, ...]:
    try:
        contexts = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ProfileError(f"bad --contexts {text!r}: expected comma-separated integers like 128,512,2048") from None
    if not contexts or contexts[0] < 1:
        raise ProfileError(f"bad --contexts {text!r}: context lengths must be >= 1")
    return contexts


def plan_cache_len(contexts: Sequence[int], buckets: Sequence[int], block_size: int, limit: int,
                   max_len: int | None = None) -> int:
    """The KV cache length: every cell writes up to max(bucket, drafter feature buffer) slots past its
    context, so the longest context + that slack must fit (rounded up to 256, capped by the model's positions)."""
    from bastion_jax.tree_decoding import pending_slots

    slack = max(max(buckets), block_size, pending_slots(block_size))
    need = max(contexts) + slack + 1
    if max_len is None:
        if need > limit:
            raise ProfileError(f"context {max(contexts)} + {slack} slots for the tree/block exceeds the model's "
                               f"{limit} positions; use shorter --contexts or smaller --buckets")
        return max(16, min(-(-need // 256) * 256, limit))
    if max_len > limit:
        raise ProfileError(f"--max-len {max_len} exceeds the model's {limit} positions")
    if need > max_len or max_len < 16:
        raise ProfileError(f"context {max(contexts)} + {slack} slots for the tree/block does not fit --max-len "
                           f"{max_len}; raise --max-len or use shorter --contexts")
    return max_len


# -- measurement ------------------------------------------------------------------------------------

def _median_s(run: Callable[[], object], reps: int, warmup: int) -> float:
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
    from bastion_jax.latency import AR, AR_DRAFT
    from bastion_jax.tree_decoding import DRAFT, HOLD
    from bastion_jax.sampling import SamplingConfig

    buckets = engine.buckets
    sampling = SamplingConfig()
    compile_counter.compilations()  # start listening before anything compiles
    bar = tqdm(total=len(contexts) * (len(buckets) + 1) + 1, desc="profile", unit="cell", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    bar.set_postfix_str("compiling")
    t0 = time.perf_counter()
    exe = engine.executables
    prefill, steps = exe.tree(1, 16, cache_len, sampling, buckets)
    roots = exe.roots(1, cache_len, sampling) if engine.drafter is not None else {}
    verify, draft = exe.tree_parts(1, cache_len, buckets)
    _, ar_step = exe.ar(1, 16, cache_len, sampling)
    compile_s = time.perf_counter() - t0
    bar.update()

    tstate = engine.target.state
    dstate = engine.drafter.state if engine.drafter else None
    key = jax.random.PRNGKey(0)
    state, curve = prefill(tstate, dstate, exe.new_cache(1, cache_len), exe.new_drafter_cache(1, cache_len),
                           jnp.zeros((1, 16), jnp.int32), jnp.ones((1,), jnp.int32), key)
    ar_cache = exe.new_cache(1, cache_len)
    features = jnp.zeros(exe.feature_shape(1), exe.feature_dtype)  # [1, block, taps * hidden]
    zero_tok = jax.device_put(np.zeros(1, np.int32))
    active = jax.device_put(np.ones(1, bool))  # the AR step writes its K/V, as when decoding
    inactive = jax.device_put(np.zeros(1, bool))  # rows stay put: every rep runs at the same context
    loop_latency = copy.deepcopy(engine.latency)  # the host loop's online updates must not touch the fit
    controller = Controller(Policy("bastion"), buckets, loop_latency)
    rng = jax.random.PRNGKey(1)
    rng, _ = jax.random.split(rng)  # compiles the eager split outside the timed region

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
            nxt, box["ar"] = ar_step(tstate, box["ar"], zero_tok, length, key, active)
            jax.block_until_ready(nxt)

        def drafting():
            s = box["state"]
            tree, _, dcache = draft(tstate, dstate, s.drafter_cache, features, ctx_start, one, zero_tok)
            box["state"] = s.replace(drafter_cache=dcache)
            jax.block_until_ready(tree.tokens)

        ar_step_s[c] = _median_s(ar, reps, warmup)
        draft_s = _median_s(drafting, reps, warmup)
        for then, variant in ((HOLD, AR), (DRAFT, AR_DRAFT)):  # the root (AR) step, as the draft gate prices it
            if then in roots:
                def root_step(root=roots[then]):
                    box["state"], out, _ = root(tstate, dstate, box["state"], inactive, key)
                    jax.block_until_ready(out.count)

                root_samples.append((variant, c, _median_s(root_step, reps, warmup)))
        bar.update()
        for b in buckets:
            bar.set_postfix_str(f"bucket {b} context {c}")
            step = steps[b]

            def full():
                box["state"], out, box["curve"] = step(tstate, dstate, box["state"], inactive, key)
                jax.block_until_ready(out.count)

            def verifying():
                s = box["state"]
                choices, tcache = verify[b](tstate, s.target_cache, s.tree, length)
                box["state"] = s.replace(target_cache=tcache)
                jax.block_until_ready(choices)

            step_s = _median_s(full, reps, warmup)
            verify_s = _median_s(verifying, reps, warmup)
            # Host overhead is a difference of two timings, so both are taken in alternating rounds
            # (a slow spell of the machine hits both) and the median round is kept.
            device_rounds, loop_rounds = [], []
            for r in range(ROUNDS):
                w = warmup if r == 0 else 0
                device_rounds.append(_device_time(full, step, tstate, dstate, box, inactive, key, reps, w))
                loop_rounds.append(_host_loop(step, tstate, dstate, box, controller, loop_latency, b, c, rng, reps, w))
            device_s, loop_s = statistics.median(device_rounds), statistics.median(loop_rounds)
            cells.append(dict(bucket=b, context=c, step_s=step_s, device_s=device_s, verify_s=verify_s,
                              draft_s=draft_s, loop_s=loop_s, host_s=loop_s - device_s))
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
    the host runs ahead, so this is the device's time per step."""
    import jax

    for _ in range(warmup):
        full()
    t0 = time.perf_counter()
    for _ in range(reps):
        box["state"], out, box["curve"] = step(tstate, dstate, box["state"], inactive, key)
    jax.block_until_ready((box["state"], out, box["curve"]))
    return (time.perf_counter() - t0) / reps


def _host_loop(step, tstate, dstate, box: dict, controller, latency, b: int, c: int, rng, reps: int,
               warmup: int) -> float:
    """Seconds per iteration of the engine's tree decode loop (`Engine.stream`), bucket pinned to b:
    rng split, the bastion controller's choice (computed, then overridden), dispatch, the reads of
    emitted tokens and counts, the online latency update and the per-row bookkeeping."""
    import jax

    active = np.zeros(1, bool)  # inactive: the context stays at c, as in the other measurements
    lengths = np.full(1, c, np.int32)
    t0 = 0.0
    for i in range(warmup + reps):
        if i == warmup:
            t0 = time.perf_counter()
        rng, sub = jax.random.split(rng)
        controller.choose(np.asarray(box["curve"]), c, np.ones(1, bool))
        ts = time.perf_counter()
        box["state"], out, box["curve"] = step(tstate, dstate, box["state"], jax.device_put(active), sub)
        toks, counts = np.asarray(out.tokens), np.asarray(out.count)
        latency.observe(b, c, time.perf_counter() - ts)
        _ = [toks[r, : counts[r]] for r in range(toks.shape[0])]
        lengths = lengths + np.where(active, counts, 0).astype(np.int32)
    return (time.perf_counter() - t0) / reps


# -- reports ----------------------------------------------------------------------------------------

def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}" if math.isfinite(s) else "-"


def markdown(title: str, meta: dict, prof: Profile) -> str:
    peaks = meta["peaks"]
    lines = [f"# {title}", "",
             f"{meta['device']}, {meta['date']}, {meta['dtype']}, target {meta['model']}, cache {prof.cache_len} "
             f"slots, batch 1, median of {meta['reps']} (after {meta['warmup']} warm-up)", "",
             f"Peaks ({peaks['source']}): {peaks['bandwidth'] / 1e9:.1f} GB/s copy bandwidth, "
             f"{peaks['flops'] / 1e12:.3f} TFLOP/s matmul; datasheet {meta['datasheet']['bandwidth'] / 1e9:.0f} GB/s, "
             f"{meta['datasheet']['flops'] / 1e12:.1f} TFLOP/s.", "",
             f"Calibrated model error (RMSE / mean step): {100 * prof.calibration_error:.2f}%. "
             f"Compilations during timing: {prof.compilations_during_timing}. Compile time {prof.compile_s:.1f}s.", "",
             "| bucket | context | step ms | device ms | verify ms | draft ms | host ms | host % | roofline ms "
             "| calibrated ms | error % |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in prof.points:
        lines.append(f"| {p.bucket} | {p.context} | {_ms(p.step_s)} | {_ms(p.device_s)} | {_ms(p.verify_s)} | "
                     f"{_ms(p.draft_s)} | {_ms(p.host_s)} | {100 * p.host_s / p.loop_s:.1f} | {_ms(p.roofline_s)} | "
                     f"{_ms(p.calibrated_s)} | {100 * (p.calibrated_s - p.step_s) / p.step_s:+.1f} |")
    lines += ["", "| context | AR step ms |", "|---|---|"]
    lines += [f"| {c} | {_ms(t)} |" for c, t in prof.ar_step_s.items()]
    return "\n".join(lines) + "\n"


def plot(prof: Profile, path: Path, title: str) -> None:
    """Left: step latency vs bucket, one colour per context (measured solid, roofline dashed,
    calibrated dotted). Right: the step's parts at the longest context."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    contexts = sorted({p.context for p in prof.points})
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colours = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, len(contexts)))
    for c, colour in zip(contexts, colours):
        pts = sorted((p for p in prof.points if p.context == c), key=lambda p: p.bucket)
        xs = [p.bucket for p in pts]
        ax.plot(xs, [p.step_s * 1e3 for p in pts], "o-", color=colour, label=f"c={c} measured")
        ax.plot(xs, [p.roofline_s * 1e3 for p in pts], "--", color=colour, label=f"c={c} roofline")
        ax.plot(xs, [p.calibrated_s * 1e3 for p in pts], ":", color=colour, alpha=0.8)
    ax.set(yscale="log", xlabel="bucket (tree nodes verified)", ylabel="step latency (ms)",
           title="step: measured (solid), roofline (dashed), calibrated (dotted)")
    ax.legend(fontsize=7, ncol=2)
    last = sorted((p for p in prof.points if p.context == contexts[-1]), key=lambda p: p.bucket)
    xs = [p.bucket for p in last]
    for attr, label in (("step_s", "full step"), ("device_s", "device (back to back)"), ("verify_s", "verify only"),
                        ("draft_s", "draft + tree build"), ("host_s", "host overhead (<= 0 not drawn)")):
        ys = [getattr(p, attr) * 1e3 if getattr(p, attr) > 0 else math.nan for p in last]
        ax2.plot(xs, ys, "o-", label=label)
    if contexts[-1] in prof.ar_step_s:
        ax2.axhline(prof.ar_step_s[contexts[-1]] * 1e3, color="grey", ls="--", label="AR step")
    ax2.set(yscale="log", xlabel="bucket", ylabel="ms", title=f"parts of a step at context {contexts[-1]}")
    ax2.legend(fontsize=7)
    buckets = sorted({p.bucket for p in prof.points})
    for a in (ax, ax2):
        if buckets[-1] > buckets[0]:
            a.set_xscale("log", base=2)
        a.set_xticks(buckets, [str(b) for b in buckets])
        a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        a.grid(True, which="major", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- CLI --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from bastion_jax.presets import PRESETS

    p = argparse.ArgumentParser(prog="python -m bastion_jax.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", help=f"named architecture with random weights: {', '.join(PRESETS)}")
    p.add_argument("--target", help="target checkpoint (converted dir, HF dir or .gguf)")
    p.add_argument("--drafter", help="with --target: DFlash drafter dir, or 'random' (default: a tiny random drafter "
                   "fitting the target, as `generate --drafter random`)")
    p.add_argument("--layers", type=int, help="--arch: keep only the first N target layers (quick CI runs)")
    p.add_argument("--drafter-layers", type=int, help="--arch: drafter layers (default: the preset's)")
    p.add_argument("--block-size", type=int, help="drafter block size (--arch default: the preset's; random "
                   "drafter default 16)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: --target's own dtype (as `generate`); --arch: bfloat16 on GPU/TPU, float32 on CPU")
    p.add_argument("--buckets", default=",".join(map(str, DEFAULT_BUCKETS)),
                   help="tree sizes to time (default: the engine's, so the calibration fits `generate`)")
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)),
                   help="committed context lengths (default 128,512,2048)")
    p.add_argument("--max-len", type=int, help="KV cache length (default: longest context + slack, rounded to 256)")
    p.add_argument("--draft-vocab", default="auto", help="drafter LM head over the N most frequent tokens: auto, "
                   "full or N (as in generate; part of the calibration key)")
    p.add_argument("--tree-top-k", type=int, default=128, help="tree width: drafter candidates per position "
                   "(default 128, as `generate`; part of the calibration key)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per cell (median; default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions first (default 2)")
    p.add_argument("--peaks", default="measure", choices=["measure", "datasheet"],
                   help="roofline peaks: measured copy bandwidth + matmul rate (default), or the datasheet table")
    p.add_argument("--copy-mib", type=int, help="size of the bandwidth probe (default 1024 on GPU, 64 on CPU)")
    p.add_argument("--matmul-n", type=int, help="matmul probe size n (default 8192 on GPU, 1024 on CPU)")
    p.add_argument("--out-dir", default="profiles", help="where to write the files (default ./profiles)")
    p.add_argument("--name", help="file name stem (default: <arch or target>-<device>-<dtype>)")
    p.add_argument("--install", action="store_true", help="also save the calibration where `generate` looks "
                   "for it (~/.cache/bastion_jax/calibration/<key>.json; the key covers the device, the target and "
                   "drafter files, dtype, buckets and tree width)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    return p


@dataclasses.dataclass
class Setup:
    """Everything `main` resolved from the flags, before timing."""

    engine: object
    model_name: str  # the calibration key's models part (`calibration.calibration_model` for --target)
    label: str  # arch or target name, for titles and file names
    contexts: tuple[int, ...]
    cache_len: int


def setup(args, log=lambda msg: None) -> Setup:
    """Validate flags (cheap checks first), build or load the models, make the engine with the
    roofline peaks the flags ask for."""
    import jax.numpy as jnp

    from bastion_jax.calibration import calibration_model
    from bastion_jax.cli import resolve_dtype
    from bastion_jax.speculative import resolve_draft_vocab
    from bastion_jax.latency import DevicePeaks

    if bool(args.arch) == bool(args.target):
        raise ProfileError("give exactly one of --arch NAME (random weights) or --target PATH")
    if args.arch and args.drafter:
        raise ProfileError("--drafter goes with --target; --arch builds its own drafter")
    if args.target and (args.layers is not None or args.drafter_layers is not None):
        raise ProfileError("--layers/--drafter-layers only apply to --arch")
    if args.reps < 1 or args.warmup < 0:
        raise ProfileError(f"--reps must be >= 1 and --warmup >= 0 (got {args.reps}, {args.warmup})")
    if args.tree_top_k < 1:
        raise ProfileError(f"--tree-top-k must be >= 1, got {args.tree_top_k}")
    try:
        buckets = parse_buckets(args.buckets)
    except PolicyError as e:
        raise ProfileError(str(e)) from None
    contexts = parse_contexts(args.contexts)
    dtype = resolve_dtype(args.dtype)

    from bastion_jax.engine import Engine

    if args.arch:
        import jax

        from bastion_jax.presets import preset_configs, random_models

        if dtype is None:  # random weights have no dtype of their own
            dtype = jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
        tcfg, dcfg = preset_configs(args.arch, args.layers, args.drafter_layers, args.block_size)
        cache_len = plan_cache_len(contexts, buckets, dcfg.block_size, tcfg.max_position_embeddings, args.max_len)
        log(f"building {args.arch} ({tcfg.num_hidden_layers} layers, {tcfg.param_count() / 1e6:.0f}M params) + "
            f"{dcfg.num_hidden_layers}-layer drafter, random {jnp.dtype(dtype).name} weights")
        target, drafter = random_models(tcfg, dcfg, dtype, args.seed)
        label = args.arch + (f"-L{args.layers}" if args.layers else "")
        model_name = f"arch:{label}|random"
        draft_vocab = None
    else:
        from bastion_jax.checkpoints import load_drafter, load_target, random_drafter
        from bastion_jax.presets import tiny_drafter_config

        target = load_target(args.target, dtype)
        drafter_arg = args.drafter or "random"
        if drafter_arg == "random":
            drafter = random_drafter(tiny_drafter_config(target.config, block_size=args.block_size or 16),
                                     target.dtype, args.seed)
        else:
            drafter = load_drafter(drafter_arg, target.config, target.dtype)
        cache_len = plan_cache_len(contexts, buckets, drafter.config.block_size,
                                   target.config.max_position_embeddings, args.max_len)
        label = Path(args.target).name.split(".")[0] or "target"
        draft_vocab = resolve_draft_vocab(target, drafter, args.draft_vocab)
        model_name = calibration_model(target, drafter, draft_vocab)  # what `generate` computes for the same pair
    engine = Engine(target, None, drafter=drafter, stop_ids=[], buckets=buckets, top_k=args.tree_top_k,
                    draft_vocab=draft_vocab)
    if args.peaks == "measure":
        copy_bytes = args.copy_mib << 20 if args.copy_mib else None
        log("measuring copy bandwidth and matmul rate")
        engine.latency.peaks = DevicePeaks.measure(target.dtype, copy_bytes=copy_bytes, matmul_n=args.matmul_n)
    return Setup(engine, model_name, label, contexts, cache_len)


def write_outputs(out_dir: Path, name: str, meta: dict, prof: Profile, calibration: dict,
                  make_plot: bool = True) -> dict[str, Path]:
    """<name>.calibration.json (LatencyModel.save format), <name>.json (all measurements), <name>.md,
    <name>.png. Returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"calibration": out_dir / f"{name}.calibration.json", "measurements": out_dir / f"{name}.json",
             "table": out_dir / f"{name}.md"}
    paths["calibration"].write_text(json.dumps(calibration, indent=2))
    raw = {"meta": meta, "cache_len": prof.cache_len, "compile_s": prof.compile_s,
           "compilations_during_timing": prof.compilations_during_timing,
           "calibration_rmse_over_mean": prof.calibration_error,
           "ar_step_s": {str(c): t for c, t in prof.ar_step_s.items()},
           "points": [dataclasses.asdict(p) for p in prof.points]}
    paths["measurements"].write_text(json.dumps(raw, indent=2))
    title = f"{meta['label']} on {meta['device']} ({meta['dtype']})"
    paths["table"].write_text(markdown(title, meta, prof))
    if make_plot:
        paths["plot"] = out_dir / f"{name}.png"
        plot(prof, paths["plot"], title)
    return paths


def device_meta(engine, label: str, model_name: str, reps: int, warmup: int) -> dict:
    import jax

    from bastion_jax.latency import DevicePeaks

    dev = jax.devices()[0]
    return {"device": dev.device_kind, "backend": jax.default_backend(), "date": datetime.date.today().isoformat(),
            "label": label, "model": model_name, "dtype": engine.target.dtype.name, "buckets": list(engine.buckets),
            "block_size": engine.block_size, "target_layers": engine.target.config.num_hidden_layers,
            "reps": reps, "warmup": warmup, "peaks": dataclasses.asdict(engine.latency.peaks),
            "datasheet": dataclasses.asdict(DevicePeaks.detect())}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    log = stderr_log(args.quiet)

    from bastion_jax.checkpoints import CheckpointError
    from bastion_jax.config import ConfigError
    from bastion_jax.engine import GenerationError

    try:
        s = setup(args, log)
        prof = run_profile(s.engine, s.contexts, s.cache_len, reps=args.reps, warmup=args.warmup,
                           progress=not args.quiet)
        engine = s.engine
        dtype = engine.target.dtype.name
        meta = device_meta(engine, s.label, s.model_name, args.reps, args.warmup)
        name = args.name or f"{s.label}-{engine.latency.peaks.name}-{dtype}"
        calibration = engine.latency.to_json(s.model_name, dtype, engine.top_k)
        paths = write_outputs(Path(args.out_dir), name, meta, prof, calibration, not args.no_plot)
        from bastion_jax.calibration import calibration_path

        installed = calibration_path(engine, s.model_name)
        if args.install:
            engine.latency.save(installed, s.model_name, dtype, engine.top_k)
    except (ProfileError, CheckpointError, ConfigError, GenerationError, PolicyError, ValueError) as e:
        return fail(e)
    if not args.quiet:
        print(markdown(f"{s.label} ({dtype})", meta, prof), end="")
        for kind, path in paths.items():
            print(f"wrote {kind}: {path}")
        how = "installed" if args.install else "not installed (pass --install)"
        print(f"controller calibration path: {installed} ({how})")
        if args.target:
            print(f"used by: python -m bastion_jax.generate --target {args.target} --drafter "
                  f"{args.drafter or 'random'} --buckets {','.join(map(str, engine.buckets))} --dtype {args.dtype} "
                  f"--tree-top-k {engine.top_k}"
                  + (f" --block-size {engine.block_size}" if (args.drafter or "random") == "random" else "") + " ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
