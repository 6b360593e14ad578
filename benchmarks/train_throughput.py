"""Drafter training throughput before and after, in one run (issue 13.1).

    python -m benchmarks.train_throughput [--steps 8] [--rounds 2] [--learn 0]

Times the trainer as it was at BASELINE (a commit, extracted with `git archive`) in the shipped
drafter's configuration (bastion_jax/assets/smollm2-135m-instruct-dflash/training.json: batch 4,
320 tokens, 32 anchors of 16 slots, 2 layers, full vocabulary, target forward inside the step) and
the current trainer on the same data and batches, lever by lever up to the new configuration, on
the default SmolLM2-135M target. Old and new alternate back to back (`--rounds`), each in its own
process, so background load hits both alike.

Throughput is drafter positions per second: block positions carrying a loss (nonzero label
weight) per wall second of training steps, after one untimed compile step. Steps with cached
features read them from a store filled beforehand (a later epoch); the fill time is reported as
the one-off cost per sequence. `--learn N` also trains N steps of the new configuration in
float32 and in bfloat16 matmuls from the same start and reports validation figures (does bf16
keep learning?). Writes benchmarks/results/<name>.json and .md with device, date and commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DEFAULT_DATA = REPO / "training_data" / "smollm2-135m-instruct" / "greedy.npz"
BASELINE = "3c2b866"  # the trainer before issue 13 (target in the step, full-vocabulary loss, dense block mask)
OLD = dict(batch_size=4, seq_len=320, num_anchors=32, lr=1e-3)  # the shipped drafter's training.json
LAYERS, BLOCK, TAPS = 2, 16, 3

SHAPED = "NEW at the training runs' shape (v4, v5): 8 x 384 tokens, 48 anchors per row"

# The current trainer, one lever at a time (each adds to the previous row); the last row is the new configuration.
LADDER = [
    ("new code, old settings (features every step, full vocab, float32)",
     dict(cache_features=False, draft_vocab=0, matmul_dtype="float32")),
    ("+ cached target features", dict(cache_features=True, draft_vocab=0, matmul_dtype="float32")),
    ("+ loss over the top 8192 tokens (FR-Spec)", dict(cache_features=True, draft_vocab=8192, matmul_dtype="float32")),
    ("+ bf16 matmuls, float32 accumulation = NEW", dict(cache_features=True, draft_vocab=8192, matmul_dtype="bfloat16")),
    ("NEW, first epoch (features computed in the loop)",
     dict(cache_features=False, draft_vocab=8192, matmul_dtype="bfloat16")),
    (SHAPED, dict(cache_features=True, draft_vocab=8192, matmul_dtype="bfloat16", batch_size=8, seq_len=384,
                  num_anchors=48)),
]


# -- workers (run in their own process; the old one imports bastion_jax from the baseline tree) --------

def _common(data_path: str):
    import jax.numpy as jnp

    try:  # today's module layout
        from bastion_jax.checkpoints import load_target, random_drafter
        from bastion_jax.dflash_config import DrafterConfig
    except ImportError:  # the baseline tree's
        from bastion_jax.checkpoint import load_target, random_drafter
        from bastion_jax.config import DrafterConfig
    from bastion_jax.default_model import default_target_dir
    from bastion_jax.training import TokenDataset

    target = load_target(default_target_dir(verbose=False))
    data = TokenDataset.from_files([data_path], OLD["seq_len"], target.config.vocab_size)
    dcfg = DrafterConfig.for_target(target.config, num_layers=LAYERS, block_size=BLOCK, num_taps=TAPS)
    assert target.dtype == jnp.float32
    return target, data, random_drafter(dcfg, seed=0)


def worker_old(data_path: str, steps: int) -> dict:
    """The baseline trainer's jitted step, called as its Trainer.fit called it."""
    import jax
    import jax.numpy as jnp

    from bastion_jax.training import Objective, TrainConfig, make_blocks, optimizer, sample_anchors, train_step
    from bastion_jax.training.objective import default_gamma

    target, data, drafter = _common(data_path)
    cfg = TrainConfig(steps=1000, **OLD)
    obj = Objective(block_size=BLOCK, num_anchors=cfg.num_anchors, gamma=default_gamma(BLOCK),
                    mask_token_id=drafter.config.mask_token_id)
    tx = optimizer(cfg)
    params = jax.tree.map(lambda a: jnp.array(a, jnp.float32, copy=True), drafter.state)
    opt_state = tx.init(params)
    batches, key = data.batches(cfg.batch_size, cfg.seed), jax.random.key(cfg.seed)
    times, positions = [], []
    for i in range(steps + 1):
        tokens, mask = (jnp.asarray(a) for a in next(batches))
        k = jax.random.fold_in(key, i)
        t0 = time.perf_counter()
        params, opt_state, m = train_step(params, opt_state, target.state, tokens, mask, k,
                                          target_def=target.graphdef, drafter_def=drafter.graphdef, obj=obj, tx=tx,
                                          cache_dtype=target.dtype)
        float(m.loss)
        times.append(time.perf_counter() - t0)
        blocks = make_blocks(tokens, mask, *sample_anchors(k, mask, cfg.num_anchors), obj)  # the step's own blocks
        positions.append(int(jnp.sum(blocks.weights > 0)))
    return _summary("old (baseline trainer, shipped configuration)", times, positions)


def worker_new(data_path: str, steps: int, variants: list[int]) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from bastion_jax.training import TokenDataset, Trainer, TrainConfig, batch_indices, train_step
    from bastion_jax.training.optim import set_learning_rate

    target, data, drafter = _common(data_path)
    workdir = Path(tempfile.mkdtemp(prefix="train-throughput-"))
    out = []
    for v in variants:
        name, levers = LADDER[v]
        cfg = TrainConfig(steps=1000, **{**OLD, **levers})
        if cfg.seq_len != data.tokens.shape[1]:  # another shape: its own rows and feature store
            data = TokenDataset.from_files([data_path], cfg.seq_len, target.config.vocab_size)
            workdir = Path(tempfile.mkdtemp(prefix="train-throughput-"))
        trainer = Trainer(target, drafter, cfg, workdir, log=lambda m: None)
        trainer.prepare(data)
        store = trainer.feature_store(data, "train")
        it = batch_indices(len(data), cfg.batch_size, cfg.seed)
        idx = [next(it) for _ in range(steps + 1)]
        fill = None
        if cfg.cache_features and store.cached < len(data):
            t0, rows = time.perf_counter(), len({int(i) for b in idx for i in b} - set(map(int, store.done.nonzero()[0])))
            for b in idx:
                store.get(b)
            fill = (time.perf_counter() - t0) / max(rows, 1) if rows else None
        params = jax.tree.map(lambda a: jnp.array(a, jnp.float32, copy=True), drafter.state)
        opt_state = set_learning_rate(trainer.tx.init(params), cfg.lr)  # the rate is an optimizer input
        key = jax.random.key(cfg.seed)
        times, positions = [], []
        for i, b in enumerate(idx):
            t0 = time.perf_counter()
            params, opt_state, m, _ = train_step(params, opt_state, trainer.vocab, trainer.embed, store.get(b),
                                                 jnp.asarray(data.tokens[b]), jnp.asarray(data.loss_mask[b]),
                                                 jax.random.fold_in(key, i), tx=trainer.tx, **trainer.static)
            positions.append(int(m.positions))
            times.append(time.perf_counter() - t0)
        row = _summary(name, times, positions)
        if fill is not None:
            row["feature_fill_s_per_sequence"] = round(fill, 3)
        out.append(row)
    return out


def worker_learn(data_path: str, steps: int) -> list[dict]:
    """The new configuration trained `steps` steps with float32 and with bf16 matmuls; validation figures."""
    from bastion_jax.training import Trainer, TrainConfig

    target, data, drafter = _common(data_path)
    train, val = data.split(32)
    features = Path(tempfile.mkdtemp(prefix="train-learn-"))
    out = []
    for dtype in ("float32", "bfloat16"):
        cfg = TrainConfig(steps=steps, **OLD, draft_vocab=8192, matmul_dtype=dtype, log_every=steps, save_every=steps, save_minutes=0)
        workdir = Path(tempfile.mkdtemp(prefix=f"train-learn-{dtype}-"))
        (workdir / "features").symlink_to(features)  # both runs read one feature store
        t0 = time.perf_counter()
        Trainer(target, drafter, cfg, workdir, log=lambda m: None).fit(train, val, progress=False)
        rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
        last = {r["split"]: r for r in rows}
        out.append({"matmul_dtype": dtype, "steps": steps, "seconds": round(time.perf_counter() - t0, 1),
                    "train": {k: round(last["train"][k], 4) for k in ("loss", "acc_first", "accept_len")},
                    "val": {k: round(last["val"][k], 4) for k in ("loss", "acc_first", "accept_len")}})
    return out


def _summary(name: str, times: list[float], positions: list[int]) -> dict:
    busy, pos = sum(times[1:]), sum(positions[1:])
    return {"config": name, "compile_s": round(times[0], 1), "steps": len(times) - 1,
            "s_per_step": round(busy / (len(times) - 1), 3), "positions_per_step": round(pos / (len(times) - 1), 1),
            "positions_per_s": round(pos / busy, 1)}


# -- driver ---------------------------------------------------------------------------------------------

def baseline_tree(commit: str, into: Path) -> Path:
    """The packages at `commit`, extracted (git archive) so a worker can import the old trainer."""
    archive = into / "src.tar"
    subprocess.run(["git", "archive", "-o", str(archive), commit, "bastion_jax", "checkpoints_convert"],
                   cwd=REPO, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "src", filter="data")
    return into / "src"


def run_worker(src: Path, args: list[str]) -> object:
    env = dict(os.environ, PYTHONPATH=str(src))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", *args, "--src", str(src)],
                          cwd=src, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: worker {args[0]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def device() -> str:
    import jax

    d = jax.devices()[0]
    if d.platform == "cpu":
        from bastion_jax.hardware import cpu_name

        return f"CPU ({cpu_name()}), {os.cpu_count()} cores"
    return f"{d.platform.upper()} ({d.device_kind})"


def git(*cmd: str) -> str:
    return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True).stdout.strip()


def markdown(res: dict) -> str:
    lines = [f"# {res['name']}", "",
             f"{res['device']}, {res['date']}, commit {res['commit']} vs baseline {res['baseline']}; "
             f"SmolLM2-135M-Instruct target (float32), {LAYERS}-layer drafter, block {BLOCK}, batch "
             f"{OLD['batch_size']} x {OLD['seq_len']} tokens, {OLD['num_anchors']} anchors; data {res['data']}; "
             f"{res['steps']} timed steps after a compile step, {res['rounds']} round(s) alternating old/new.", "",
             "Throughput = drafter positions per second (block positions with a loss / wall seconds of steps).", "",
             "| configuration | s/step | positions/step | positions/s | x old |", "|---|---|---|---|---|"]
    for row in res["mean"]:
        lines.append(f"| {row['config']} | {row['s_per_step']:.2f} | {row['positions_per_step']:.0f} | "
                     f"{row['positions_per_s']:.0f} | {row['speedup']:.2f} |")
    lines += ["", f"**New / old: {res['speedup']:.2f}x** (cached features, top-8192 loss, bf16 matmuls, "
              "context + own-block attention)."]
    if res.get("speedup_at_training_shape"):
        lines += ["", f"At the shape the drafters are trained with (8 x 384 tokens, 48 anchors per row): "
                  f"{res['speedup_at_training_shape']:.2f}x the old trainer at its shipped shape, with "
                  f"{res['positions_ratio_at_training_shape']:.1f}x the positions per step (longer rows and more "
                  "blocks per row cost a little more per position)."]
    if res.get("feature_fill_s_per_sequence"):
        lines += ["", f"One-off cost of caching a sequence's target features (first epoch): "
                  f"{res['feature_fill_s_per_sequence']:.2f} s per {OLD['seq_len']}-token sequence."]
    if res.get("learn"):
        lines += ["", "Learning check (same start and batches, new configuration):", "",
                  "| matmuls | steps | val loss | val acc_first | val accept_len | train loss |", "|---|---|---|---|---|---|"]
        for r in res["learn"]:
            lines.append(f"| {r['matmul_dtype']} | {r['steps']} | {r['val']['loss']:.3f} | {r['val']['acc_first']:.3f} "
                         f"| {r['val']['accept_len']:.3f} | {r['train']['loss']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_throughput", description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(DEFAULT_DATA), help="training data (JSONL or packed .npz)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration (default 8)")
    p.add_argument("--rounds", type=int, default=2, help="old/new alternations (default 2)")
    p.add_argument("--baseline", default=BASELINE, help=f"commit of the old trainer (default {BASELINE})")
    p.add_argument("--learn", type=int, default=0, help="also train N steps float32 vs bf16 (default 0: skip)")
    p.add_argument("--name", default="cpu-smollm2-train-throughput")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--variants", default=",".join(str(i) for i in range(len(LADDER))), help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        import bastion_jax

        assert Path(bastion_jax.__file__).resolve().is_relative_to(Path(args.src).resolve()), bastion_jax.__file__
        if args.worker == "old":
            result = worker_old(args.data, args.steps)
        elif args.worker == "new":
            result = worker_new(args.data, args.steps, [int(v) for v in args.variants.split(",")])
        else:
            result = worker_learn(args.data, args.steps)
        print(json.dumps(result))
        return 0

    common = ["--data", str(Path(args.data).resolve()), "--steps", str(args.steps)]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        old_src = baseline_tree(args.baseline, Path(tmp))
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}: old ...", file=sys.stderr, flush=True)
            old = run_worker(old_src, ["old", *common])
            print(f"  {old['positions_per_s']:.0f} positions/s; new ...", file=sys.stderr, flush=True)
            new = run_worker(REPO, ["new", *common, "--variants", args.variants])
            print("  " + ", ".join(f"{x['positions_per_s']:.0f}" for x in new) + " positions/s", file=sys.stderr)
            rounds.append([old, *new])
    mean = []
    for i, row in enumerate(rounds[0]):
        runs = [rd[i] for rd in rounds]
        busy = sum(x["s_per_step"] * x["steps"] for x in runs)
        pos = sum(x["positions_per_step"] * x["steps"] for x in runs)
        mean.append({"config": row["config"], "s_per_step": busy / sum(x["steps"] for x in runs),
                     "positions_per_step": pos / sum(x["steps"] for x in runs), "positions_per_s": pos / busy})
    for row in mean:
        row["speedup"] = row["positions_per_s"] / mean[0]["positions_per_s"]
    new_row = next(r for r in mean if r["config"].endswith("= NEW"))
    shaped = next((r for r in mean if r["config"] == SHAPED), None)
    fills = [x["feature_fill_s_per_sequence"] for rd in rounds for x in rd if "feature_fill_s_per_sequence" in x]
    res = {"name": args.name, "device": device(), "date": datetime.date.today().isoformat(),
           "commit": git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--",
                                                                            "bastion_jax") else ""),
           "baseline": args.baseline, "data": str(Path(args.data).resolve().relative_to(REPO)
                                                    if Path(args.data).resolve().is_relative_to(REPO) else args.data),
           "steps": args.steps, "rounds": args.rounds, "per_round": rounds, "mean": mean,
           "speedup": new_row["speedup"], "speedup_at_training_shape": shaped and shaped["speedup"],
           "positions_ratio_at_training_shape": shaped and shaped["positions_per_step"] / new_row["positions_per_step"],
           "feature_fill_s_per_sequence": sum(fills) / len(fills) if fills else None}
    if args.learn:
        print(f"learning check: {args.learn} steps float32 vs bf16 ...", file=sys.stderr, flush=True)
        res["learn"] = run_worker(REPO, ["learn", "--data", common[1], "--steps", str(args.learn)])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / f"{args.name}.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
