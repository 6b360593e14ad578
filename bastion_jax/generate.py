"""`python -m bastion_jax.generate "prompt"`: text to stdout (streamed), everything else to stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time

from bastion_jax.cli import fail, stderr_log

DEFAULT_PROMPT_HELP = "With no --target, the embedded SmolLM2-135M-Instruct is used."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bastion_jax.generate",
        description="Generate text with a target LLM. One prompt streams its text to stdout; several "
                    "prompts run as one batch and print one JSON line per prompt "
                    '({"prompt": ..., "completion": ...}). Progress and the summary go to stderr. '
                    + DEFAULT_PROMPT_HELP)
    p.add_argument("prompts", nargs="*", help="prompt text(s); read from stdin when none is given and "
                   "stdin is not a terminal")
    p.add_argument("--target", help="converted bastion_jax checkpoint dir, HF safetensors dir, or .gguf "
                   "file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="DFlash drafter: a z-lab checkpoint dir or a converted one; 'random' builds "
                   "a tiny randomly initialised drafter that fits the target (for trying the pipeline); 'none' "
                   "decodes without one. Default: the shipped SmolLM2 drafter with the default target, else none")
    p.add_argument("--mode", help="decoding policy: ar (plain autoregressive), dflash (the drafter's top-1 chain), "
                   "fixed:N (always verify an N-node tree; N must be a bucket) or bastion (the controller picks the "
                   "tree size maximising estimated tokens/s). Default: bastion with a drafter, else ar")
    p.add_argument("--buckets", help="comma-separated tree sizes (root included) compiled at warm-up "
                   "(default 1,4,8,16,32,64; fixed:N adds N)")
    p.add_argument("--top-k", dest="tree_top_k", type=int, default=128,
                   help="drafter candidates per block position when building trees (default 128, capped at the vocab)")
    p.add_argument("--compare-ar", action="store_true", help="also run plain AR on the same prompts and report "
                   "the speedup measured in this run (and whether the texts are identical)")
    p.add_argument("--no-calibrate", action="store_true", help="bastion: skip the warm-up latency profile "
                   "(use the roofline, corrected online)")
    p.add_argument("--block-size", type=int, default=16, help="block size of a --drafter random (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="maximum new tokens per prompt (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--sample-top-k", "--sampling-top-k", dest="top_k", type=int, default=0,
                   help="sample only from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed for sampling (default 0)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template; use the raw prompt")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype (auto: bfloat16 on GPU/TPU, float32 on CPU)")
    p.add_argument("--max-len", type=int, help="KV cache length in tokens (default: prompt + max new tokens, "
                   "rounded up to 256)")
    p.add_argument("--quiet", action="store_true", help="print only the generated text (no progress or summary)")
    return p


def resolve_dtype(name: str):
    import jax
    import jax.numpy as jnp

    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def calibration_path(engine, model_name: str):
    from bastion_jax.default_model import cache_root

    return cache_root() / "calibration" / f"{engine.latency.key(model_name, engine.target.dtype.name)}.json"


def load_or_calibrate(engine, model_name: str, cache_len: int, sampling, skip: bool, log) -> None:
    """Reuse a saved calibration for this device/model/dtype/buckets, else profile once at warm-up."""
    import time

    path = calibration_path(engine, model_name)
    if engine.latency.load(path, model_name, engine.target.dtype.name):
        log(f"latency calibration: reused {path}")
        return
    if skip:
        log("latency calibration: skipped (roofline + online correction)")
        return
    t0 = time.perf_counter()
    samples = engine.calibrate(cache_len, sampling)
    log(f"latency calibration: profiled {len(samples)} step timings over buckets "
        f"{','.join(map(str, engine.buckets))} in {time.perf_counter() - t0:.1f}s (saved to {path})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompts = list(args.prompts)
    if not prompts and not sys.stdin.isatty():
        prompts = [sys.stdin.read()]
    if not prompts or any(not p.strip() for p in prompts):
        print("error: give a non-empty prompt, e.g. python -m bastion_jax.generate "
              '"What is the capital of France?"', file=sys.stderr)
        return 2

    log = stderr_log(args.quiet)

    from bastion_jax.checkpoint import CheckpointError, load_drafter, load_target, random_drafter
    from bastion_jax.default_model import DefaultModelError, default_target_dir
    from bastion_jax.engine import Engine, GenerationError, Stats
    from bastion_jax.sampling import SamplingConfig
    from bastion_jax.text import IncrementalDetokenizer, encode_prompt, load_tokenizer

    try:
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
        t0 = time.perf_counter()
        path = args.target or default_target_dir(verbose=not args.quiet)
        target = load_target(path, resolve_dtype(args.dtype))
        tokenizer = load_tokenizer(target)
        log(f"loaded {path} ({target.config.model_type}, {target.config.param_count() / 1e6:.0f}M params, "
            f"{target.dtype.name}) in {time.perf_counter() - t0:.1f}s")
        drafter = None
        if args.drafter is None and args.target is None:
            from bastion_jax.default_model import default_drafter_dir

            shipped = default_drafter_dir()
            args.drafter = str(shipped) if shipped else None
        if args.drafter == "none":
            args.drafter = None
        elif args.drafter == "random":
            from bastion_jax.testing import tiny_drafter_config

            drafter = random_drafter(tiny_drafter_config(target.config, block_size=args.block_size), target.dtype)
            log(f"drafter: tiny random (block size {args.block_size}; expect few accepted tokens)")
        elif args.drafter:
            drafter = load_drafter(args.drafter, target.config, target.dtype)
            log(f"drafter: {args.drafter} ({drafter.config.num_hidden_layers} layers, block size "
                f"{drafter.config.block_size})")
        from bastion_jax.controller import DEFAULT_BUCKETS, Policy, parse_buckets

        mode = args.mode or ("bastion" if drafter else "ar")
        policy = Policy.parse(mode)
        if policy.kind != "ar" and drafter is None:
            raise ValueError(f"--mode {mode} needs --drafter DIR (or --drafter random)")
        buckets = parse_buckets(args.buckets) if args.buckets else DEFAULT_BUCKETS
        if policy.kind == "fixed" and not args.buckets:
            buckets = tuple(sorted(set(buckets) | {policy.size}))
        engine = Engine(target, tokenizer, drafter=drafter, buckets=buckets, top_k=args.tree_top_k)
        ids = [encode_prompt(tokenizer, p, chat=not args.no_chat, system=args.system) for p in prompts]
        model_name = f"{path}|{args.drafter}"
        if policy.kind == "bastion" and len(ids) == 1:
            cache_len = engine.cache_len_for([len(ids[0])], args.max_new_tokens, args.max_len,
                                             max(max(engine.buckets), engine.block_size))
            load_or_calibrate(engine, model_name, cache_len, sampling, args.no_calibrate, log)
        stats = Stats()
        gen = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                   max_len=args.max_len, stats=stats, mode=mode)
        outs: list[list[int]] = [[] for _ in ids]
        detok = IncrementalDetokenizer(tokenizer)
        for step in engine.stream(ids, **gen):
            for i, toks in enumerate(step):
                outs[i].extend(toks)
            if len(ids) == 1:
                sys.stdout.write(detok.push(step[0]))
                sys.stdout.flush()
        if len(ids) == 1:
            sys.stdout.write(detok.flush() + "\n")
        else:
            for p, o in zip(prompts, outs):
                text = tokenizer.decode(o, skip_special_tokens=True)
                print(json.dumps({"prompt": p, "completion": text}, ensure_ascii=False))
        sys.stdout.flush()
        if policy.kind == "bastion":
            engine.latency.save(calibration_path(engine, model_name), model_name, target.dtype.name)
        log(f"[{stats.mode}] prompt tokens {stats.prompt_tokens} | {stats.summary()}")
        if args.compare_ar:
            ar_stats = Stats()
            ar_out: list[list[int]] = [[] for _ in ids]
            for step in engine.stream(ids, **dict(gen, stats=ar_stats, mode="ar")):
                for i, toks in enumerate(step):
                    ar_out[i].extend(toks)
            log(f"[ar] prompt tokens {ar_stats.prompt_tokens} | {ar_stats.summary()}")
            same = ar_out == outs
            speedup = stats.tokens_per_s / ar_stats.tokens_per_s if ar_stats.tokens_per_s else float("nan")
            log(f"[compare] {stats.mode} vs ar: speedup {speedup:.2f}x (tokens/s ratio, same run) | "
                f"text identical to AR: {'yes' if same else 'no'}")
    except (CheckpointError, DefaultModelError, GenerationError, ValueError) as e:
        return fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
