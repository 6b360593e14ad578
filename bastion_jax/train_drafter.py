"""`python -m bastion_jax.train_drafter {data,pack,datastore,train,eval}`: build a DFlash drafter for a target.

`data` regenerates responses with the target itself (greedy, chat template) for prompts from
training splits and the local Python standard library; `train` runs the DFlash objective with
AdamW, checkpoints with orbax (rerun the same command to resume) and exports the drafter in the
z-lab format (`config.json` + `model.safetensors`) that `--drafter DIR` loads; `eval` reports its
acceptance (tau per mode and prompt set, output checked against AR).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from bastion_jax.acceptance_cli import add_eval_parser, eval_buckets, run_eval
from bastion_jax.cli import (DEFAULT_BLOCK_SIZE, Parser, block_size_arg, count_arg, fail, positive_int, stderr_log,
                             use_compilation_cache)

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
DEFAULT_SOURCES = ("gsm8k_train.jsonl.gz", "code_alpaca_2k.jsonl.gz")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m bastion_jax.train_drafter", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", help="target checkpoint (converted dir, HF dir or .gguf; default: the embedded "
                        "SmolLM2-135M-Instruct)")
    common.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="target compute dtype (auto: the checkpoint's own dtype; float32 for a quantised GGUF)")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--quiet", action="store_true", help="no progress bars")

    d = sub.add_parser("data", parents=[common], help="generate training sequences (prompt + target response)")
    d.add_argument("--out", required=True, help="JSONL file to write (appended to: an interrupted run resumes)")
    d.add_argument("--sources", nargs="*", help="JSONL(.gz) prompt files from training splits (default: "
                   f"{', '.join(DEFAULT_SOURCES)} from ../shared/data beside the checkout)")
    d.add_argument("--stdlib", type=count_arg, default=300, help="also use up to N prompts built from Python "
                   "standard-library sources and docs (default 300)")
    d.add_argument("--num", type=positive_int, default=2000, help="total prompts (default 2000)")
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--max-prompt-tokens", type=int, default=256, help="keep at most the last N prompt tokens")
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy responses (default); > 0 samples "
                   "them (e.g. 0.7 for varied text the target still finds likely)")
    d.add_argument("--magpie", type=count_arg, default=0, help="also use up to N prompts the target writes itself "
                   "(Magpie: the chat template's user prefix, sampled), kept in OUT.magpie.jsonl (default 0)")
    d.add_argument("--magpie-temperature", type=float, default=1.0)
    d.add_argument("--magpie-max-tokens", type=int, default=96, help="longest self-written prompt (default 96)")
    d.add_argument("--magpie-openers", nargs="?", const="chat", choices=["chat", "math", "code"],
                   help="start each self-written prompt with an opening phrase of a kind "
                   "(training.prompt_sources.OPENER_SETS): chat (the default when given bare: write, explain, "
                   "role-play, solve, code, extract, ...; spreads prompts over a chat benchmark's kinds), math "
                   "(competition-style LaTeX problems: 'Let $f(x) =', 'How many positive integers', ...) or code "
                   "(programming tasks: 'Write a Python function that', 'Given a list of integers,', ...)")
    d.add_argument("--docstrings", type=count_arg, default=0, help="also use up to N function-completion prompts: a "
                   "signature and docstring from the Python standard library's sources, body left out (default 0)")
    d.add_argument("--methods", type=count_arg, default=0, help="also use up to N method-completion prompts: a class "
                   "statement and one of its methods' signature and docstring, from the same sources (default 0)")
    d.add_argument("--passages", type=count_arg, default=0, help="also use up to N tasks over a passage of prose "
                   "(summarise, list the main points, explain, rewrite) cut from the standard library's language "
                   "reference topics and module docstrings (default 0)")
    d.add_argument("--passage-chars", type=positive_int, default=1000, help="longest --passages passage, in characters "
                   "(default 1000; ~4 characters a token)")
    d.add_argument("--text-tasks", type=count_arg, default=0, help="also use up to N tasks (summarise, rewrite, "
                   "extract, answer) over responses the target wrote before, read from --text-from (default 0)")
    d.add_argument("--text-from", nargs="+", default=[], help="training data files (JSONL / .npz) whose "
                   "responses --text-tasks poses its tasks over")

    k = sub.add_parser("pack", help="store data JSONL files compactly (uint16 ids, compressed .npz) to commit, "
                       "or unpack a .npz back to JSONL (to resume `data` on it)")
    k.add_argument("--data", nargs="+", required=True, help="JSONL / .npz files written by data or pack")
    k.add_argument("--out", required=True, help=".npz file to write (or .jsonl: unpack)")
    k.add_argument("--vocab-size", type=positive_int, default=None,
                   help="target vocabulary (default: the largest token id + 1)")
    k.add_argument("--quiet", action="store_true")

    s = sub.add_parser("datastore", help="build a datastore of target-written text (datastore.npz beside a "
                       "drafter: generate's lookup then also offers chains copied from it), its hit rates measured "
                       "on held-out greedy rows")
    s.add_argument("--data", nargs="+", required=True, help="JSONL / .npz files written by data or pack")
    s.add_argument("--out", required=True, help=".npz file to write (e.g. DRAFTER_DIR/datastore.npz)")
    s.add_argument("--vocab-size", type=positive_int, default=None,
                   help="target vocabulary (default: the packed files')")
    s.add_argument("--held-out", type=int, default=400, help="greedy rows whose prompts measure the hit rates")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--quiet", action="store_true")

    t = sub.add_parser("train", parents=[common], help="train (or resume) and export a drafter")
    t.add_argument("--data", nargs="+", required=True, help="JSONL file(s) written by the data command")
    t.add_argument("--out", required=True, help="work dir: checkpoints/, metrics.jsonl, drafter/ (the final export), best/ (the export of the best validation step, best.json its figures)")
    t.add_argument("--init", help="start from this drafter checkpoint instead of a random one (and keep the token "
                   "ranking stored beside it, so the loss vocabulary stays the one it was trained on); a fresh run "
                   "validates it first, as step 0, so best/ holds a trained step only where one beats it")
    t.add_argument("--layers", type=positive_int, help="drafter layers (default 2; with --init: the init's own, and a larger "
                   "N grows it: copies of its last layer whose output projections start at zero, so the deeper "
                   "drafter starts out drafting exactly as the init)")
    t.add_argument("--num-taps", type=positive_int, help="target layers tapped for features (default: max(layers, "
                   "3); with --init: the init's own, and a larger N whose DFlash taps contain them widens it, the new "
                   "taps' fc columns starting at zero)")
    t.add_argument("--block-size", type=block_size_arg,
                   help=f"drafter block size (default {DEFAULT_BLOCK_SIZE}; with --init, its own)")
    t.add_argument("--intermediate-size", type=int, help="drafter MLP width (default: the target's)")
    t.add_argument("--mask-token-id", type=int, help="token whose embedding marks masked slots (default: vocab-1)")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--anchors", type=int, default=64, help="blocks per sequence (default 64)")
    t.add_argument("--lr", type=_positive_number, default=6e-4)
    t.add_argument("--warmup-ratio", type=float, default=0.04)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--max-grad-norm", type=float, default=1.0)
    t.add_argument("--gamma", type=float, help="loss decay (default: 7 for B=16, 5 for 10, 4 for 8)")
    t.add_argument("--held-out", type=int, default=64, help="sequences kept aside for validation (default 64)")
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--save-every", type=positive_int, default=200, help="checkpoint (under OUT/checkpoints, for "
                   "--resume) every N steps (default 200)")
    t.add_argument("--save-minutes", type=_minutes, default=5.0, help="... and whenever this many minutes passed "
                   "since the last checkpoint (default 5; 0: by steps only)")
    t.add_argument("--eval-every", type=int, default=0)
    t.add_argument("--walk-rows", type=int, default=32, help="held-out rows whose first --walk-window response "
                   "positions validation walks as greedy decoding does (the tau that picks the best step; 0: the "
                   "teacher-forced tau over uniform anchors, which overstates decoding's; default 32)")
    t.add_argument("--walk-window", type=int, default=96, help="response positions walked per row (default 96)")
    t.add_argument("--export-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    t.add_argument("--draft-vocab", default="auto", help="score the loss over the N most frequent tokens of the "
                   "training responses (FR-Spec; labels outside get no loss), 0 = the full vocabulary; auto: "
                   "8192 when the vocabulary is larger (default), as generate --draft-vocab auto drafts")
    t.add_argument("--matmul-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="drafter dense-layer products: bfloat16 operands accumulated in float32 (default; "
                   "master weights, norms and softmax stay float32) or float32 throughout")
    t.add_argument("--distill", type=float, default=0.0, metavar="W",
                   help="mix in soft labels with weight W in [0, 1]: the target's own next-token law at each "
                   "label (its logits over the loss vocabulary), as (1 - W) * hard + W * soft cross-entropy "
                   "(default 0: the hard labels alone)")
    t.add_argument("--no-feature-cache", action="store_true", help="recompute target features every step "
                   "instead of keeping them under OUT/features (for data seen only once)")
    t.add_argument("--reuse-features", nargs="+", default=[], metavar="DIR",
                   help="other runs' features/ directories: rows whose target features are stored there (same "
                   "target, taps and tokens) are copied instead of recomputed")
    t.add_argument("--ema", type=float, default=0.0, metavar="DECAY",
                   help="validate and export an exponential moving average of the weights with this decay per step, "
                        "started at the starting weights (e.g. 0.998 when continuing a trained drafter; default 0: "
                        "the weights as trained)")
    t.add_argument("--miss-weight", type=float, default=1.0, metavar="W",
                   help="draw anchors where a row's chains first missed on its last visit W times as often (decoding "
                        "anchors there, after a token the drafter got wrong; default 1: uniform anchors)")
    t.add_argument("--cond-head", type=positive_int, metavar="RANK", help="add a parent-conditioned output head "
                   "of this rank (each slot's law given the token before it; exported beside the drafter as "
                   "cond_head.json / .safetensors); an --init drafter's own head is kept (same rank)")
    t.add_argument("--cond-head-recurrent", action="store_true", help="with --cond-head: a head that carries a "
                   "state from slot to slot, so each slot's law sees every token before it back to the root, not "
                   "only the last (an --init head without one grows it at zero: it starts out drafting as before)")
    t.add_argument("--freeze-drafter", action="store_true", help="train only the conditioned head (the drafter's "
                   "weights stay as --init gave them)")
    t.add_argument("--marginal", type=float, metavar="W", help="with a conditioned head trained together with "
                   "the drafter: add W times the loss of the drafter's own law (without the head), which drafting "
                   "without the head (--cond-head off) and a tree's deeper levels read (default 1.0 when a head "
                   "trains with its drafter: at 0 the head-free law decays, chain tau 1.70 -> 1.53 in 8,000 GPU "
                   "steps; 0 when there is no head or it trains alone)")
    t.add_argument("--resume", action="store_true", help="continue OUT's latest checkpoint and refuse to start "
                   "without one (a rerun without --resume also continues a checkpoint it finds, and says so)")
    t.add_argument("--max-seconds", type=_positive_seconds, help="stop after this much wall time (at a step boundary: "
                   "validated, checkpointed, exported; resumable), e.g. inside a session or device lease")
    t.add_argument("--trace", metavar="DIR", help="trace three training steps (this process's 6th to 8th) with "
                   "jax.profiler into DIR and summarise them per XLA op (DIR/step-trace.md: the target's feature "
                   "forward against the drafter's step)")
    t.add_argument("--init-from-target", action="store_true", help="initialise the drafter's layers from the "
                   "target's last layers (its fc stays random)")
    add_eval_parser(sub, common)
    return p


def _finite(unit: str, zero_ok: bool):
    """An argparse type for a finite number of `unit` above 0 (or at least 0 with `zero_ok`): --max-seconds,
    --save-minutes, --lr; anything else is refused while parsing."""
    import math

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
            what = f"a number of {unit}" if unit else "a number"
            raise argparse.ArgumentTypeError(f"must be {what} {'>=' if zero_ok else '>'} 0, got {text!r}")
        return value

    return parse


_positive_seconds = _finite("seconds", zero_ok=False)
_positive_number = _finite("", zero_ok=False)  # --lr
_minutes = _finite("minutes", zero_ok=True)


def drafter_config(target_cfg, args):
    from bastion_jax.dflash_config import DrafterConfig

    layers = 2 if args.layers is None else args.layers
    return DrafterConfig.for_target(target_cfg, num_layers=layers, block_size=args.block_size or DEFAULT_BLOCK_SIZE,
                                    num_taps=args.num_taps or max(layers, 3),
                                    intermediate_size=args.intermediate_size, mask_token_id=args.mask_token_id)


def run_data(args, target, log) -> None:
    from bastion_jax.engine import Engine
    from bastion_jax.text import load_tokenizer
    from bastion_jax.training.data import (DataError, file_prompts, generate_responses, magpie_prompts, mix_prompts,
                                           read_records)
    from bastion_jax.training.prompt_sources import (OPENER_SETS, docstring_prompts, method_prompts,
                                                         own_text_prompts, passage_prompts, stdlib_prompts)

    paths = [Path(s) for s in args.sources] if args.sources is not None else [DEFAULT_DATA_DIR / n
                                                                              for n in DEFAULT_SOURCES]
    sources = [(p.name.split(".")[0], file_prompts(p)) for p in paths]
    if args.stdlib:
        sources.append(("python_stdlib", stdlib_prompts(args.stdlib, args.seed)))
    if args.docstrings:
        sources.append(("docstrings", docstring_prompts(args.docstrings, args.seed)))
    if args.methods:
        sources.append(("methods", method_prompts(args.methods, args.seed)))
    if args.passages:
        sources.append(("passages", passage_prompts(args.passages, args.seed, max_chars=args.passage_chars)))
    try:  # (before hours of generation, not after)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot write --out {args.out}: {e}") from None
    tokenizer = load_tokenizer(target)
    if args.text_tasks:
        texts = [tokenizer.decode(list(r["response_ids"]), skip_special_tokens=True)
                 for f in args.text_from for r in read_records(f)]
        sources.append(("text_tasks", own_text_prompts(texts, args.text_tasks, args.seed)))
    engine = Engine(target, tokenizer)
    if args.magpie:
        own = magpie_prompts(engine, tokenizer, args.magpie, f"{args.out}.magpie.jsonl",
                             temperature=args.magpie_temperature, max_new_tokens=args.magpie_max_tokens,
                             batch_size=args.batch_size, seed=args.seed, progress=not args.quiet,
                             openers=OPENER_SETS[args.magpie_openers] if args.magpie_openers else ())
        sources.append(("magpie", own))
    prompts = mix_prompts(sources, args.num, args.seed)
    log(f"{len(prompts)} prompts from " + ", ".join(f"{n} ({len(p)})" for n, p in sources))
    n = generate_responses(engine, tokenizer, prompts, args.out, max_new_tokens=args.max_new_tokens,
                           max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size,
                           temperature=args.temperature, seed=args.seed, progress=not args.quiet)
    log(f"wrote {n} sequences to {args.out}")


def draft_vocab_size(spec: str, vocab_size: int) -> int:
    """--draft-vocab: auto (8192 when the vocabulary is larger, else full), 0 (full) or a token count."""
    from bastion_jax.speculative import DEFAULT_DRAFT_VOCAB

    if spec == "auto":
        return DEFAULT_DRAFT_VOCAB if vocab_size > DEFAULT_DRAFT_VOCAB else 0
    try:
        n = int(spec)
    except ValueError:
        raise ValueError(f"--draft-vocab must be auto or a token count (0 = full), got {spec!r}") from None
    if n < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0 = the full vocabulary), got {n}")
    return 0 if n >= vocab_size else n


def run_train(args, target, log) -> None:
    import jax
    import jax.numpy as jnp

    from bastion_jax.checkpoints import load_drafter, random_drafter
    from bastion_jax.training import (TokenDataset, TrainConfig, Trainer, add_head, grow, init_from_target,
                                      load_ranking, save_ranking, widen_taps)
    from bastion_jax.checkpoints.dflash import export_zlab

    missing = [d for d in args.reuse_features if not Path(d).is_dir()]
    if missing:
        raise ValueError(f"--reuse-features: no such directory {missing[0]}")
    checkpoints = Path(args.out) / "checkpoints"
    if args.resume and not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        raise ValueError(f"--resume: no checkpoint to continue in {checkpoints}")
    if args.init and args.init_from_target:
        raise ValueError("--init and --init-from-target both choose the starting weights; pass one")
    if args.cond_head_recurrent and not args.cond_head:
        raise ValueError("--cond-head-recurrent grows a conditioned head: give its rank (--cond-head R)")
    fixed = [f for f, v in (("--intermediate-size", args.intermediate_size), ("--mask-token-id", args.mask_token_id))
             if v is not None]
    if args.init and fixed:
        raise ValueError(f"{fixed[0]} sets a new drafter's shape; an --init drafter keeps its own")
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, num_anchors=args.anchors,
                      lr=args.lr, warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay,
                      max_grad_norm=args.max_grad_norm, gamma=args.gamma, seed=args.seed, log_every=args.log_every,
                      save_every=args.save_every, save_minutes=args.save_minutes, eval_every=args.eval_every,
                      draft_vocab=draft_vocab_size(args.draft_vocab, target.config.vocab_size),
                      matmul_dtype=args.matmul_dtype, cache_features=not args.no_feature_cache,
                      distill=args.distill, walk_rows=args.walk_rows, walk_window=args.walk_window, ema=args.ema,
                      miss_weight=args.miss_weight, freeze_drafter=args.freeze_drafter,
                      marginal=args.marginal or 0.0)
    data = TokenDataset.from_files(args.data, cfg.seq_len, target.config.vocab_size)
    if data.duplicates:
        log(f"data: {data.duplicates} rows repeat another row exactly and are dropped ({len(data)} distinct)")
    train, val = data.split(args.held_out)
    if args.init:
        # unrolled layers: the trainer's checkpoints and warm start are per layer on every backend
        # (its conditioned head too, if it has one: it trains with the drafter, whatever the backend)
        drafter = load_drafter(args.init, target.config, jnp.float32, scan_layers=False, cond_head=True)
        init_cfg = drafter.config  # before growing or widening (the init note says what changed)
        if args.block_size not in (None, init_cfg.block_size):  # fixed by the drafter's training: not ignored
            raise ValueError(f"--block-size {args.block_size} differs from --init's block size {init_cfg.block_size}")
        if args.layers is not None:
            drafter = grow(drafter, args.layers)
        if args.num_taps is not None:
            drafter = widen_taps(drafter, args.num_taps)
    else:
        dcfg = drafter_config(target.config, args)
        dcfg.check_pair(target.config)
        drafter = random_drafter(dcfg, seed=args.seed)
        if args.init_from_target:
            drafter = init_from_target(drafter, target)
    if args.cond_head:
        drafter = add_head(drafter, args.cond_head, seed=args.seed, recurrent=args.cond_head_recurrent)
    if args.freeze_drafter and not args.init:
        raise ValueError("--freeze-drafter keeps the drafter's weights: start from a trained one (--init DIR)")
    d = drafter.config
    if args.marginal is None and d.cond_head_rank and not args.freeze_drafter:
        # a head trained with its drafter: keep the drafter's own law trained too. On the head's loss
        # alone it drifts (8,000 GPU steps took the evaluation sets' head-free chain tau 1.70 -> 1.53
        # while the head's rose 1.87 -> 2.04: benchmarks/results/cpu-smollm2-drafter-v17-ab.md), and
        # --cond-head off and the tree's deeper levels draft from it
        cfg = dataclasses.replace(cfg, marginal=1.0)
    log(f"drafter: {d.num_hidden_layers} layers, taps {list(d.target_layer_ids)}, block {d.block_size}, "
        f"{sum(x.size for x in jax.tree.leaves(drafter.state)) / 1e6:.1f}M params | "
        f"data: {len(train)} train / {len(val)} val sequences of <= {cfg.seq_len} tokens | loss vocabulary: "
        f"{cfg.draft_vocab or 'full'} | matmuls: {cfg.matmul_dtype}")
    out = Path(args.out)
    ranking = load_ranking(Path(args.init)) if args.init else None  # keep the loss vocabulary it was trained on
    init_note = args.init or ("target's last layers" if args.init_from_target else "random")
    if args.init and d.num_hidden_layers > init_cfg.num_hidden_layers:
        init_note += f" (grown from {init_cfg.num_hidden_layers} to {d.num_hidden_layers} layers: warmstart.grow)"
    if d.cond_head_rank and not (args.init and init_cfg.cond_head_rank):
        init_note += f" (a new conditioned head of rank {d.cond_head_rank}: warmstart.add_head)"
    elif d.cond_head_recurrent and not init_cfg.cond_head_recurrent:
        init_note += " (its conditioned head made recurrent, `rec` at zero: warmstart.add_head)"
    if args.init and d.target_layer_ids != init_cfg.target_layer_ids:
        init_note += (f" (taps {list(init_cfg.target_layer_ids)} widened to {list(d.target_layer_ids)}: "
                      "warmstart.widen_taps)")
    def record(state, directory: Path, **extra) -> Path:
        head_info = {"trained": "see training.json", "frozen_drafter": cfg.freeze_drafter} if d.cond_head_rank else None
        export = export_zlab(d, state, directory, getattr(jnp, args.export_dtype), info=head_info)
        save_ranking(export, trainer.ranking)  # what generate --draft-vocab reads beside config.json
        (export / "training.json").write_text(json.dumps(
            {"train_config": dataclasses.asdict(cfg), "data": [str(p) for p in args.data], "target": str(target.path),
             "init": init_note, **trainer.run_facts(), **extra,  # device, date, step reached, seconds (+ total)
             "vocab_ranking": {"file": "vocab_ranking.npy", "source": "training responses",
                               "order": "int32 token ids, most frequent first, ties by id"}}, indent=2))
        return export

    trainer = Trainer(target, drafter, cfg, out, log=log, ranking=ranking,
                      reuse_features=tuple(Path(p) for p in args.reuse_features),
                      on_best=lambda state, ev: record(state, out / "best", validation=ev))
    trained = trainer.fit(train, val if len(val) else None, progress=not args.quiet, max_seconds=args.max_seconds,
                          validate_start=bool(args.init), trace_dir=args.trace)
    export = record(trained.state, out / "drafter", best_validation=trainer.best())
    best = trainer.best() or {}
    what = "step 0: no trained step beat the --init drafter" if best.get("step") == 0 else f"step {best.get('step')}"
    log(f"exported {export} ({sum(f.stat().st_size for f in export.iterdir()) / 1e6:.1f} MB)"
        + (f"; the best validation ({what}) is in {out / 'best'}" if best else ""))


def run_pack(args, log) -> int:
    from bastion_jax.training.data import pack_records, read_records

    records = [r for p in args.data for r in read_records(p)]
    if args.out.endswith(".jsonl"):
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        log(f"unpacked {len(records)} sequences into {args.out}")
        return 0
    vocab = args.vocab_size or 1 + max((t for r in records for t in r["prompt_ids"] + r["response_ids"]), default=0)
    out = pack_records(records, args.out, vocab)
    n = sum(len(r["response_ids"]) for r in records)
    log(f"packed {len(records)} sequences ({n} response tokens) into {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


def run_datastore(args, log) -> int:
    from bastion_jax.training.datastore_build import build_from_files

    build_from_files(args.data, args.out, args.vocab_size, held_out=args.held_out, seed=args.seed, log=log)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    log = stderr_log(args.quiet)
    use_compilation_cache()

    from bastion_jax.checkpoints import CheckpointError, load_target
    from bastion_jax.config import ConfigError
    from bastion_jax.default_model import DefaultModelError, default_target_dir
    from bastion_jax.cli import dtype_note, resolve_dtype
    from bastion_jax.training.data import DataError

    try:
        if args.command == "pack":
            return run_pack(args, log)
        if args.command == "datastore":
            return run_datastore(args, log)
        if args.command == "eval":  # modes the buckets cannot run: refused before the target loads
            eval_buckets(args.modes, args.buckets)
        if args.command == "data" and bool(args.text_tasks) != bool(args.text_from):
            raise DataError("--text-tasks N and --text-from FILES go together: the tasks, and the data files "
                            "whose responses they are posed over")
        path = args.target or default_target_dir(verbose=not args.quiet)
        target = load_target(path, resolve_dtype(args.dtype))
        log(f"loaded {path} ({target.dtype.name}: {dtype_note(args.dtype)})")
        {"data": run_data, "train": run_train, "eval": run_eval}[args.command](args, target, log)
    except (CheckpointError, ConfigError, DataError, DefaultModelError, ValueError) as e:
        return fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
