"""`python -m bastion_jax.profile`: per bucket x context timings of the BASTION step, the roofline and
its calibration, written as the controller's calibration JSON + a plot + a markdown table.

    python -m bastion_jax.profile --arch qwen3-8b --contexts 512,2048,4096
    python -m bastion_jax.profile --target DIR --drafter DIR --install
    python -m bastion_jax.profile --arch smollm2-135m --layers 2 --buckets 1,4,8 --contexts 64,128

Measurements (see `bastion_jax.profiler`): per bucket x context the full step, its device time, the
verify and draft halves and the host loop's own time, plus the plain AR step per context; the
roofline made with the device's measured copy bandwidth and matmul rate, and the per-bucket linear
calibration fitted to the step times.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

from bastion_jax.cli import (DEFAULT_BLOCK_SIZE, Parser, add_cond_head_flags, add_lookup_flag, block_size_arg,
                             check_block_size, check_cond_head, fail, positive_int, resolve_cond_head, resolve_lookup,
                             stderr_log)
from bastion_jax.controller import PolicyError, default_buckets, parse_buckets
from bastion_jax.profile_report import device_meta, markdown, write_outputs
from bastion_jax.profiler import run_profile

DEFAULT_CONTEXTS = (128, 512, 2048)


class ProfileError(ValueError):
    """Bad profiler input (reported as one `error:` line)."""


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


# -- CLI --------------------------------------------------------------------------------------------

LAYOUTS = {"auto": None, "unrolled": False, "scanned": True}


def add_layout_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers-layout", default="auto", choices=list(LAYOUTS),
                   help="decoder layers unrolled or under one scan (auto: `checkpoints.default_scan_layers`, "
                        "unrolled); the drafter follows the target")


def build_parser() -> argparse.ArgumentParser:
    from bastion_jax.presets import PRESETS

    p = Parser(prog="python -m bastion_jax.profile", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", help=f"named architecture with random weights: {', '.join(PRESETS)}")
    p.add_argument("--target", help="target checkpoint (converted dir, HF dir or .gguf)")
    p.add_argument("--drafter", help="with --target: DFlash drafter dir, or 'random' (default: a tiny random drafter "
                   "fitting the target, as `generate --drafter random`)")
    p.add_argument("--layers", type=int, help="--arch: keep only the first N target layers (quick CI runs)")
    p.add_argument("--drafter-layers", type=int, help="--arch: drafter layers (default: the preset's)")
    p.add_argument("--block-size", type=block_size_arg, help="drafter block size, >= 2 (--arch default: the "
                   "preset's; --target: of its random drafter, default 16; a loaded drafter has its own)")
    add_layout_flag(p)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: --target's own dtype (as `generate`); --arch: bfloat16 on GPU/TPU, float32 on CPU")
    p.add_argument("--buckets", help="tree sizes to time (default: the engine's, 1,4,8,16,32,64 or on CPU 1,4,8,16, "
                   "so the calibration fits `generate`)")
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)),
                   help="committed context lengths (default 128,512,2048)")
    p.add_argument("--max-len", type=int, help="KV cache length (default: longest context + slack, rounded to 256)")
    p.add_argument("--draft-vocab", default="auto", help="drafter LM head over the N most frequent tokens: auto, "
                   "full or N (as in generate; part of the calibration key)")
    add_lookup_flag(p)
    add_cond_head_flags(p)
    p.add_argument("--tree-top-k", type=int, default=128, help="tree width: drafter candidates per position "
                   "(default 128, as `generate`; part of the calibration key)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per cell (median; default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions first (default 2)")
    p.add_argument("--peaks", default="measure", choices=["measure", "datasheet"],
                   help="roofline peaks: measured copy bandwidth + matmul rate (default), or the datasheet table")
    p.add_argument("--copy-mib", type=positive_int, help="size of the bandwidth probe (default 1024 on GPU, 64 on CPU)")
    p.add_argument("--matmul-n", type=positive_int, help="matmul probe size n (default 8192 on GPU, 1024 on CPU)")
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

    from bastion_jax.calibration import calibration_model, with_lookup
    from bastion_jax.cli import resolve_dtype
    from bastion_jax.speculative import asks_for_draft_vocab, resolve_draft_vocab
    from bastion_jax.latency import DevicePeaks

    lookup = resolve_lookup(getattr(args, "lookup", "on"))  # perf_8b's own flags have no --lookup: on
    if bool(args.arch) == bool(args.target):
        raise ProfileError("give exactly one of --arch NAME (random weights) or --target PATH")
    if args.arch and args.drafter:
        raise ProfileError("--drafter goes with --target; --arch builds its own drafter")
    if args.target and (args.layers is not None or args.drafter_layers is not None):
        raise ProfileError("--layers/--drafter-layers only apply to --arch")
    if args.target:  # --arch sizes its own drafter's blocks with it
        check_block_size(args.block_size, args.drafter or "random")
    if args.arch:  # its random drafter has no token ranking and no datastore: a value here would be ignored
        given = []
        if asks_for_draft_vocab(getattr(args, "draft_vocab", "auto")):
            given.append(f"--draft-vocab {args.draft_vocab}")
        if getattr(args, "datastore", "auto") not in ("auto", "off"):
            given.append(f"--datastore {args.datastore}")
        if given:
            raise ProfileError(f"{', '.join(given)} go with --target's drafter; --arch builds a random drafter "
                               "without a token ranking or a datastore")
    if args.reps < 1 or args.warmup < 0:
        raise ProfileError(f"--reps must be >= 1 and --warmup >= 0 (got {args.reps}, {args.warmup})")
    if args.tree_top_k < 1:
        raise ProfileError(f"--tree-top-k must be >= 1, got {args.tree_top_k}")
    try:
        buckets = parse_buckets(args.buckets) if args.buckets else default_buckets()
    except PolicyError as e:
        raise ProfileError(str(e)) from None
    contexts = parse_contexts(args.contexts)
    dtype = resolve_dtype(args.dtype)
    scan = LAYOUTS[getattr(args, "layers_layout", "auto")]
    if scan and getattr(args, "install", False):  # generate loads unrolled layers: the file would never be read
        raise ProfileError("--install profiles the layout generate runs: drop --layers-layout scanned (generate "
                           "loads unrolled layers and would never read a scanned calibration)")

    from bastion_jax.engine import Engine

    if args.arch:
        import jax

        from bastion_jax.checkpoints import layer_layout
        from bastion_jax.presets import preset_configs, random_models

        if dtype is None:  # random weights have no dtype of their own
            dtype = jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
        tcfg, dcfg = preset_configs(args.arch, args.layers, args.drafter_layers, args.block_size)
        tcfg = layer_layout(tcfg, scan, dtype=dtype)  # as load_target lays out a real checkpoint
        dcfg = layer_layout(dcfg, tcfg.scan_layers, feature_major=tcfg.feature_major)  # as load_drafter lays it out
        cache_len = plan_cache_len(contexts, buckets, dcfg.block_size, tcfg.max_position_embeddings, args.max_len)
        log(f"building {args.arch} ({tcfg.num_hidden_layers} layers, {tcfg.param_count() / 1e6:.0f}M params) + "
            f"{dcfg.num_hidden_layers}-layer drafter, random {jnp.dtype(dtype).name} weights")
        target, drafter = random_models(tcfg, dcfg, dtype, args.seed)
        label = args.arch + (f"-L{args.layers}" if args.layers else "") + ("-scanned" if tcfg.scan_layers else "")
        model_name = with_lookup(f"arch:{label}|random", lookup is not None)
        draft_vocab = datastore = None
    else:
        from bastion_jax.checkpoints import load_drafter, load_target, random_drafter
        from bastion_jax.datastore import resolve_datastore
        from bastion_jax.presets import tiny_drafter_config

        target = load_target(args.target, dtype, scan_layers=scan)
        drafter_arg = args.drafter or "random"
        if drafter_arg == "random":
            block = DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size
            drafter = random_drafter(tiny_drafter_config(target.config, block_size=block), target.dtype, args.seed)
        else:
            drafter = load_drafter(drafter_arg, target.config, target.dtype,
                                   cond_head=resolve_cond_head(getattr(args, "cond_head", "auto")))
        cache_len = plan_cache_len(contexts, buckets, drafter.config.block_size,
                                   target.config.max_position_embeddings, args.max_len)
        label = (Path(args.target).name.split(".")[0] or "target") + ("-scanned" if target.config.scan_layers else "")
        draft_vocab = resolve_draft_vocab(target, drafter, getattr(args, "draft_vocab", "auto"))
        datastore = resolve_datastore(getattr(args, "datastore", "auto"), target, drafter, lookup)
        model_name = None
    check_cond_head(getattr(args, "cond_head", "auto"), drafter)  # (--arch's drafter is random: no head)
    engine = Engine(target, None, drafter=drafter, stop_ids=[], buckets=buckets, top_k=args.tree_top_k,
                    draft_vocab=draft_vocab, lookup=lookup, datastore=datastore,
                    cond_depths=getattr(args, "cond_depths", None), cond_candidates=getattr(args, "cond_candidates", None))
    if model_name is None:  # what `generate` computes for the same pair and flags
        model_name = calibration_model(target, drafter, engine.draft_vocab, lookup=lookup is not None,
                                       datastore=datastore, cond_depths=engine.cond_depths,
                                       cond_candidates=engine.cond_candidates)
    if args.peaks == "measure":
        copy_bytes = args.copy_mib << 20 if args.copy_mib else None
        log("measuring copy bandwidth and matmul rate")
        engine.latency.peaks = DevicePeaks.measure(target.dtype, copy_bytes=copy_bytes, matmul_n=args.matmul_n)
    return Setup(engine, model_name, label, contexts, cache_len)


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
