"""`python -m bastion_jax.generate "prompt"`: text to stdout (streamed), everything else to stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time

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
                   "a tiny randomly initialised drafter that fits the target (for trying the pipeline)")
    p.add_argument("--mode", choices=["ar", "dflash"], help="decoding mode: ar = plain autoregressive; dflash = "
                   "chain speculative decoding with the drafter (default: dflash when --drafter is given, else ar)")
    p.add_argument("--block-size", type=int, default=16, help="block size of a --drafter random (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="maximum new tokens per prompt (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="sample only from the k most likely tokens (0 = off)")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompts = list(args.prompts)
    if not prompts and not sys.stdin.isatty():
        prompts = [sys.stdin.read()]
    if not prompts or any(not p.strip() for p in prompts):
        print("error: give a non-empty prompt, e.g. python -m bastion_jax.generate "
              '"What is the capital of France?"', file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

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
        if args.drafter == "random":
            from bastion_jax.testing import tiny_drafter_config

            drafter = random_drafter(tiny_drafter_config(target.config, block_size=args.block_size), target.dtype)
            log(f"drafter: tiny random (block size {args.block_size}; expect few accepted tokens)")
        elif args.drafter:
            drafter = load_drafter(args.drafter, target.config, target.dtype)
            log(f"drafter: {args.drafter} ({drafter.config.num_hidden_layers} layers, block size "
                f"{drafter.config.block_size})")
        if args.mode == "dflash" and drafter is None:
            raise ValueError("--mode dflash needs --drafter DIR (or --drafter random)")
        mode = args.mode or ("dflash" if drafter else "ar")
        engine = Engine(target, tokenizer, drafter=drafter)
        ids = [encode_prompt(tokenizer, p, chat=not args.no_chat, system=args.system) for p in prompts]
        stats = Stats()
        gen = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                   max_len=args.max_len, stats=stats, mode=mode)
        if len(ids) == 1:
            detok = IncrementalDetokenizer(tokenizer)
            for step in engine.stream(ids, **gen):
                sys.stdout.write(detok.push(step[0]))
                sys.stdout.flush()
            sys.stdout.write(detok.flush() + "\n")
        else:
            outs: list[list[int]] = [[] for _ in ids]
            for step in engine.stream(ids, **gen):
                for i, toks in enumerate(step):
                    outs[i].extend(toks)
            for p, o in zip(prompts, outs):
                text = tokenizer.decode(o, skip_special_tokens=True)
                print(json.dumps({"prompt": p, "completion": text}, ensure_ascii=False))
        sys.stdout.flush()
    except (CheckpointError, DefaultModelError, GenerationError, ValueError) as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    log(f"[{stats.mode}] prompt tokens {stats.prompt_tokens} | {stats.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
