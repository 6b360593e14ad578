"""`python -m bastion_jax.generate "prompt"`: text to stdout (streamed), everything else to stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time

from bastion_jax.calibration import calibration_model, load_or_calibrate
from bastion_jax.cli import (DEFAULT_BLOCK_SIZE, Parser, add_cond_head_flags, add_lookup_flag, add_sampling_flags,
                             block_size_arg, check_block_size, check_cond_head, dtype_note, fail, positive_int,
                             resolve_cond_head, resolve_dtype, resolve_lookup, stderr_log, use_compilation_cache)

DEFAULT_PROMPT_HELP = "With no --target, the embedded SmolLM2-135M-Instruct is used."
WARMUP_TOKENS = 8  # new tokens of each untimed --compare-ar warm-up run


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
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
                   "fixed:N (always verify an N-node tree, compiled beside --buckets), bastion (the controller picks the "
                   "tree size maximising estimated tokens/s; a plain AR step where drafting does not pay) or "
                   "bastion-paper (the official BASTION size rule, for comparison). Default: bastion with a drafter, "
                   "else ar")
    p.add_argument("--buckets", help="comma-separated tree sizes (root included) compiled at warm-up "
                   "(default 1,4,8,16,32,64, on CPU 1,4,8,16; fixed:N adds N, bastion-paper compiles 1,4,8,16,32,64)")
    p.add_argument("--draft-vocab", default="auto", help="drafter LM head restricted to the N most frequent "
                   "target tokens (FR-Spec; the ranking ships beside the drafter as vocab_ranking.npy): auto (8192 "
                   "when the drafter has a ranking), full, or N. Output is unchanged: verification uses every token")
    add_cond_head_flags(p)
    add_lookup_flag(p)
    p.add_argument("--tree-top-k", type=int, default=128,
                   help="tree width: drafter candidates per block position when building trees (default 128, "
                        "capped at the vocab)")
    p.add_argument("--compare-ar", action="store_true", help="also run plain AR on the same prompts and report "
                   "the speedup measured in this run (both modes warmed up first and timed alike) and, at "
                   "temperature 0, whether the texts are identical")
    p.add_argument("--no-calibrate", action="store_true", help="bastion: do not profile at warm-up (a saved "
                   "calibration for this exact setting is still used; else the roofline, corrected online); "
                   "never writes a calibration")
    p.add_argument("--recalibrate", action="store_true", help="bastion: profile at warm-up even when a calibration "
                   "is saved for this setting, and save it over the old one (one taken while the machine was busy "
                   "prices steps unevenly, and bastion then drafts less than it should)")
    p.add_argument("--block-size", type=block_size_arg, help="block size of a --drafter random (>= 2, default "
                   f"{DEFAULT_BLOCK_SIZE}; a loaded drafter has its own)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="maximum new tokens per prompt (default 256)")
    add_sampling_flags(p)
    p.add_argument("--sample-top-k", "--sampling-top-k", dest="top_k", type=int, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the old spelling of --top-k
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template; use the raw prompt")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype (auto: the checkpoint's own dtype, except the embedded default pair on a CPU "
                        "with bf16 units, AVX512-BF16 or AMX: bfloat16; quantised GGUF tensors are dequantised to "
                        "float32). The drafter computes in the target's dtype")
    p.add_argument("--max-len", type=int, help="KV cache length in tokens (default: prompt + max new tokens + the "
                   "tree's slack, rounded up to a size class: 256, 384, 512, 768, ...); too small for them is an "
                   "error, never a shorter answer")
    p.add_argument("--quiet", action="store_true", help="print only the generated text (no progress or summary)")
    return p


# -- the run ---------------------------------------------------------------------------------------

def load_models(args, log):
    """(target path, target, drafter or None), as the flags ask; logs what was loaded and in which dtype."""
    from bastion_jax.checkpoints import load_drafter, load_target, random_drafter
    from bastion_jax.default_model import default_target_dir

    check_block_size(args.block_size, args.drafter)
    if args.tree_top_k < 1:
        raise ValueError(f"--tree-top-k must be >= 1 (drafter candidates per block position), got {args.tree_top_k}")
    if args.recalibrate and args.no_calibrate:
        raise ValueError("--recalibrate profiles and --no-calibrate does not: give one of them")
    t0 = time.perf_counter()
    path = args.target or default_target_dir(verbose=not args.quiet)
    dtype = resolve_dtype(args.dtype, default_pair=args.target is None)
    target = load_target(path, dtype)
    import jax

    layout = ""  # on CPU the layout this machine multiplies fastest (checkpoints.layout_probe: measured once)
    if jax.default_backend() == "cpu":
        layout = {"in-out": ", layer weights [in, out]", "out-in": ", layer weights [out, in]",
                  "feature-major": ", layer weights [out, in], feature-major products"}[target.config.weights_layout]
    log(f"loaded {path} ({target.config.model_type}, {target.config.param_count() / 1e6:.0f}M params, "
        f"{target.dtype.name}: {dtype_note(args.dtype, dtype)}{layout}) in {time.perf_counter() - t0:.1f}s")
    drafter_arg = args.drafter
    if drafter_arg is None and args.target is None:
        from bastion_jax.default_model import default_drafter_dir

        shipped = default_drafter_dir()
        drafter_arg = str(shipped) if shipped else None
    if drafter_arg in (None, "none"):
        return path, target, None
    if drafter_arg == "random":
        from bastion_jax.presets import tiny_drafter_config

        block = DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size
        drafter = random_drafter(tiny_drafter_config(target.config, block_size=block), target.dtype)
        log(f"drafter: tiny random (block size {block}, {target.dtype.name} like the target; expect few accepted "
            "tokens)")
        return path, target, drafter
    # computes in the target's dtype
    drafter = load_drafter(drafter_arg, target.config, target.dtype,
                           cond_head=resolve_cond_head(getattr(args, "cond_head", "auto")))
    head = drafter.config.head_words
    log(f"drafter: {drafter_arg} ({drafter.config.num_hidden_layers} layers, block size "
        f"{drafter.config.block_size}{f', {head}' if head else ''}, computing in "
        f"{target.dtype.name} like the target)")
    return path, target, drafter


def run(engine, ids: list[list[int]], gen: dict, on_step=None):
    """(new tokens per prompt, Stats) of one `Engine.stream`; `on_step` sees each step's tokens.
    The engine's timings exclude the time spent in `on_step`."""
    from bastion_jax.engine import Stats

    stats = Stats()
    outs: list[list[int]] = [[] for _ in ids]
    for step in engine.stream(ids, **gen, stats=stats):
        for i, toks in enumerate(step):
            outs[i].extend(toks)
        if on_step is not None:
            on_step(step)
    return outs, stats


def compare_line(stats, ar_stats, same: bool, temperature: float) -> str:
    speedup = stats.tokens_per_s / ar_stats.tokens_per_s if ar_stats.tokens_per_s else float("nan")
    if temperature == 0:
        verdict = f"text identical to AR: {'yes' if same else 'no'}"
    else:  # each mode draws its own random samples: different texts are expected, not a fault
        verdict = (f"texts not compared (temperature {temperature:g}: each run draws its own samples; both "
                   "follow the target's distribution)")
    return (f"[compare] {stats.mode} vs ar: speedup {speedup:.2f}x (tokens/s ratio, same run, both warmed up, "
            f"same cache, printing excluded) | {verdict}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompts = list(args.prompts)
    if not prompts and not sys.stdin.isatty():
        prompts = [sys.stdin.read()]
    if not prompts or any(not p.strip() for p in prompts):
        print("error: give a non-empty prompt, e.g. python -m bastion_jax.generate "
              '"What is the capital of France?"', file=sys.stderr)
        return 2
    if args.no_chat and args.system is not None:  # a raw prompt has no system turn to put it in
        print("error: --system goes into the chat template, which --no-chat leaves out: drop one of them",
              file=sys.stderr)
        return 2

    log = stderr_log(args.quiet)
    use_compilation_cache()

    from bastion_jax.checkpoints import CheckpointError
    from bastion_jax.controller import DEFAULT_BUCKETS, Policy, default_buckets, parse_buckets
    from bastion_jax.default_model import DefaultModelError
    from bastion_jax.engine import Engine, GenerationError
    from bastion_jax.shapes import prefill_bucket
    from bastion_jax.sampling import SamplingConfig
    from bastion_jax.speculative import asks_for_draft_vocab, resolve_draft_vocab
    from bastion_jax.text import IncrementalDetokenizer, encode_prompt, load_tokenizer

    try:
        # Settings first: a typo is reported before seconds of loading and a minute of calibration.
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
        policy = Policy.parse(args.mode) if args.mode else None
        path, target, drafter = load_models(args, log)
        check_cond_head(args.cond_head, drafter)
        tokenizer = load_tokenizer(target)

        mode = args.mode or ("bastion" if drafter else "ar")
        policy = policy or Policy.parse(mode)
        if policy.kind != "ar" and drafter is None:
            raise ValueError(f"--mode {mode} needs --drafter DIR (or --drafter random)")
        # (bastion-paper's sizes come in steps of 32: it compiles the full default set everywhere)
        buckets = (parse_buckets(args.buckets) if args.buckets
                   else DEFAULT_BUCKETS if policy.kind == "bastion-paper" else default_buckets())
        if policy.kind == "fixed" and not args.buckets:
            buckets = tuple(sorted(set(buckets) | {policy.size}))
        if asks_for_draft_vocab(args.draft_vocab) and (drafter is None or policy.kind == "ar"):
            raise ValueError(f"--draft-vocab {args.draft_vocab} restricts a drafter's LM head in the tree modes; "
                             f"--mode {mode} drafts nothing")
        draft_vocab = resolve_draft_vocab(target, drafter, args.draft_vocab)
        if draft_vocab is not None and policy.kind == "dflash":
            log("draft vocabulary: the full vocabulary (--mode dflash drafts over every token; --draft-vocab "
                "applies to the tree modes)")
        elif draft_vocab is not None:
            log(f"draft vocabulary: the {draft_vocab.ids.shape[0]} most frequent tokens (--draft-vocab full: all)")
        engine = Engine(target, tokenizer, drafter=drafter, buckets=buckets, top_k=args.tree_top_k,
                        draft_vocab=draft_vocab, lookup=resolve_lookup(args.lookup), datastore=args.datastore,
                        cond_depths=args.cond_depths, cond_candidates=args.cond_candidates)
        engine.progress = not args.quiet
        if engine.datastore is not None and policy.uses_tree:
            log(f"datastore: {engine.datastore.tokens.shape[0]:,} target-written tokens for the lookup's chains "
                "(--datastore off: the context's chains only)")
        ids = [encode_prompt(tokenizer, p, chat=not args.no_chat, system=args.system) for p in prompts]
        # One cache length for every run of this request (the compared AR run too: same attention cost).
        cache_len = engine.cache_len_for([len(x) for x in ids], args.max_new_tokens, args.max_len,
                                         engine.slack(policy))
        if policy.kind == "bastion":  # (a batch's steps are profiled and saved at its own size)
            model = calibration_model(target, drafter, engine.draft_vocab, lookup=engine.lookup is not None,
                                      datastore=engine.datastore, cond_depths=engine.cond_depths,
                                      cond_candidates=engine.cond_candidates)
            load_or_calibrate(engine, model, cache_len, sampling, args.no_calibrate, log,
                              prefill_bucket(max(len(x) for x in ids), cache_len), batch=len(ids),
                              refresh=args.recalibrate, progress=not args.quiet)
        gen = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, max_len=cache_len)
        if args.compare_ar:
            # Both modes compile and run once on these prompts before either is timed.
            t0 = time.perf_counter()
            for m in dict.fromkeys((mode, "ar")):
                run(engine, ids, dict(gen, mode=m, max_new_tokens=min(args.max_new_tokens, WARMUP_TOKENS)))
            log(f"[compare] warm-up: {mode} and ar compiled and run once (untimed, {time.perf_counter() - t0:.1f}s)")
        detok = IncrementalDetokenizer(tokenizer)

        def show(step):
            sys.stdout.write(detok.push(step[0]))
            sys.stdout.flush()

        outs, stats = run(engine, ids, dict(gen, mode=mode), show if len(ids) == 1 else None)
        if len(ids) == 1:
            sys.stdout.write(detok.flush() + "\n")
        else:
            for p, o in zip(prompts, outs):
                text = tokenizer.decode(o, skip_special_tokens=True)
                print(json.dumps({"prompt": p, "completion": text}, ensure_ascii=False))
        sys.stdout.flush()
        log(f"[{stats.mode}] prompt tokens {stats.prompt_tokens} | {stats.summary()}")
        if args.compare_ar:
            ar_out, ar_stats = run(engine, ids, dict(gen, mode="ar"))
            log(f"[ar] prompt tokens {ar_stats.prompt_tokens} | {ar_stats.summary()}")
            log(compare_line(stats, ar_stats, ar_out == outs, args.temperature))
    except (CheckpointError, DefaultModelError, GenerationError, ValueError) as e:
        return fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
