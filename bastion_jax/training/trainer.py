"""Drafter training: one jitted step (frozen target features + DFlash objective + AdamW), a resumable loop.

The target runs inside the step (its features are never stored: for SmolLM2 they would be ~6 KB
per token), under `stop_gradient`; only the drafter's parameters are differentiated. The split
target state is an argument, not a closure constant, so XLA does not fold 100M+ weights into the
executable.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bastion_jax.checkpoint import LoadedDrafter, Target
from bastion_jax.modeling.cache import KVCache, causal_mask
from bastion_jax.training.data import TokenDataset
from bastion_jax.training.objective import Blocks, Metrics, Objective, block_loss, default_gamma, make_blocks, sample_anchors


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch_size: int = 8
    seq_len: int = 512
    num_anchors: int = 64
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    gamma: float | None = None  # None: DFlash's value for the block size
    seed: int = 0
    log_every: int = 10
    save_every: int = 200
    eval_every: int = 0  # 0: only at the end

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        if not 1 <= self.num_anchors < self.seq_len:
            raise ValueError(f"num_anchors must be in [1, seq_len), got {self.num_anchors} for seq_len {self.seq_len}")


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up, cosine decay to 10% and global-norm clipping (DFlash recipe)."""
    warmup = max(1, int(round(cfg.warmup_ratio * cfg.steps)))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), cfg.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))


def target_features(target, tokens: jax.Array, tap_layers: tuple[int, ...], cache_dtype) -> jax.Array:
    """Tapped target layer outputs for whole sequences tokens [b, S] -> [b, S, n_taps * hidden]."""
    b, s = tokens.shape
    start = jnp.zeros((b,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
    cache = KVCache.create(target.config, b, s, cache_dtype)
    out = target(tokens, positions, cache, start, causal_mask(start, s, s), tap_layers=tap_layers,
                 logits_index=jnp.zeros((b, 1), jnp.int32))
    return jax.lax.stop_gradient(out.taps)


def blocks_forward(target, drafter, tokens: jax.Array, loss_mask: jax.Array, key: jax.Array, obj: Objective,
                   cache_dtype) -> tuple[jax.Array, Blocks]:
    """Logits [b, N, B-1, vocab] of every block of a batch, and the blocks (labels, weights)."""
    b = tokens.shape[0]
    features = target_features(target, tokens, drafter.config.target_layer_ids, cache_dtype)  # [b, S, F]
    anchors, valid = sample_anchors(key, loss_mask, obj.num_anchors)
    blocks = make_blocks(tokens, loss_mask, anchors, valid, obj)
    n, block = blocks.ids.shape[1:]
    emb = jax.lax.stop_gradient(target.embed_tokens(blocks.ids.reshape(b, n * block)))  # [b, T, h]
    hidden = drafter.forward_blocks(emb, blocks.positions.reshape(b, n * block), features, blocks.mask)
    hidden = hidden.reshape(b, n, block, -1)[:, :, 1:]  # slot 0 is the anchor itself: untrained
    return target.logits(hidden), blocks


def _loss(params, drafter_def, target, tokens, loss_mask, key, obj, cache_dtype):
    drafter = nnx.merge(drafter_def, params)
    logits, blocks = blocks_forward(target, drafter, tokens, loss_mask, key, obj, cache_dtype)
    metrics = block_loss(logits, blocks)
    return metrics.loss, metrics


_STATIC = ("target_def", "drafter_def", "obj", "tx", "cache_dtype")


@partial(jax.jit, static_argnames=_STATIC, donate_argnames=("params", "opt_state"))
def train_step(params, opt_state, target_state, tokens, loss_mask, key, *, target_def, drafter_def, obj: Objective,
               tx: optax.GradientTransformation, cache_dtype):
    """One AdamW step on a batch tokens/loss_mask [b, S]; returns new params, opt state and metrics."""
    target = nnx.merge(target_def, target_state)
    grads, metrics = jax.grad(_loss, has_aux=True)(params, drafter_def, target, tokens, loss_mask, key, obj,
                                                    cache_dtype)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics


@partial(jax.jit, static_argnames=("target_def", "drafter_def", "obj", "cache_dtype"))
def eval_step(params, target_state, tokens, loss_mask, key, *, target_def, drafter_def, obj: Objective, cache_dtype):
    target = nnx.merge(target_def, target_state)
    return _loss(params, drafter_def, target, tokens, loss_mask, key, obj, cache_dtype)[1]


def _mean(metrics: list[Metrics]) -> dict[str, float]:
    """Weight-averaged metrics over several batches (batches without trainable blocks count 0)."""
    w = np.array([float(m.weight) for m in metrics])
    total = max(w.sum(), 1e-9)
    return {f: float(sum(float(getattr(m, f)) * wi for m, wi in zip(metrics, w)) / total)
            for f in ("loss", "acc_first", "accept_len")}


@dataclasses.dataclass
class Trainer:
    """Trains `drafter` against a frozen `target` on `train`; resumable through an orbax CheckpointManager.

    `workdir/checkpoints` holds the latest steps (params + optimizer state + data position);
    `workdir/metrics.jsonl` logs training and validation metrics.
    """

    target: Target
    drafter: LoadedDrafter
    cfg: TrainConfig
    workdir: Path
    log: Callable[[str], None] = print

    def __post_init__(self):
        self.workdir = Path(self.workdir)
        d = self.drafter.config
        self.drafter.config.check_pair(self.target.config)
        self.obj = Objective(block_size=d.block_size, num_anchors=self.cfg.num_anchors,
                             gamma=self.cfg.gamma or default_gamma(d.block_size), mask_token_id=d.mask_token_id)
        self.tx = optimizer(self.cfg)
        self.static = dict(target_def=self.target.graphdef, drafter_def=self.drafter.graphdef, obj=self.obj,
                           cache_dtype=self.target.dtype)

    def _manager(self):
        import orbax.checkpoint as ocp

        options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1, create=True)
        return ocp.CheckpointManager((self.workdir / "checkpoints").absolute(), options=options)

    def _restore(self, mngr, params, opt_state):
        import orbax.checkpoint as ocp

        step = mngr.latest_step()
        if step is None:
            return 0, params, opt_state
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                              meta=ocp.args.JsonRestore()))
        meta = restored["meta"]
        if meta.get("train_config") != dataclasses.asdict(self.cfg):
            self.log(f"note: resuming step {step} with a different training config than the one saved")
        self.log(f"resumed from {self.workdir / 'checkpoints'} at step {step}")
        return step, restored["state"]["params"], restored["state"]["opt_state"]

    def _save(self, mngr, step: int, params, opt_state) -> None:
        import orbax.checkpoint as ocp

        meta = {"train_config": dataclasses.asdict(self.cfg), "drafter_config": self.drafter.config.to_hf()}
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                                                meta=ocp.args.JsonSave(meta)), force=True)

    def evaluate(self, params, data: TokenDataset, batches: int = 4) -> dict[str, float]:
        it = data.batches(self.cfg.batch_size, seed=self.cfg.seed + 1)
        key = jax.random.key(self.cfg.seed + 1)
        ms = []
        for i in range(min(batches, max(1, math.ceil(len(data) / self.cfg.batch_size)))):
            tokens, mask = next(it)
            ms.append(eval_step(params, self.target.state, jnp.asarray(tokens), jnp.asarray(mask),
                                jax.random.fold_in(key, i), **self.static))
        return _mean(ms)

    def fit(self, train: TokenDataset, val: TokenDataset | None = None, progress: bool = True) -> LoadedDrafter:
        """Run to `cfg.steps` (resuming if checkpoints exist); returns the trained drafter (fp32)."""
        from tqdm import tqdm

        self.workdir.mkdir(parents=True, exist_ok=True)
        params = jax.tree.map(lambda a: jnp.array(a, jnp.float32, copy=True), self.drafter.state)  # fp32 master copy (donated)
        opt_state = self.tx.init(params)
        mngr = self._manager()
        step, params, opt_state = self._restore(mngr, params, opt_state)
        key = jax.random.key(self.cfg.seed)
        batches = train.batches(self.cfg.batch_size, self.cfg.seed, start_step=step)
        history: list[Metrics] = []
        log_path = self.workdir / "metrics.jsonl"
        t0, seen = time.perf_counter(), 0
        bar = tqdm(total=self.cfg.steps, initial=step, disable=not progress, desc="train", unit="step")
        while step < self.cfg.steps:
            tokens, mask = next(batches)
            params, opt_state, m = train_step(params, opt_state, self.target.state, jnp.asarray(tokens),
                                              jnp.asarray(mask), jax.random.fold_in(key, step), tx=self.tx,
                                              **self.static)
            step += 1
            seen += int(mask.sum())
            history.append(m)
            bar.update(1)
            if step % self.cfg.log_every == 0 or step == self.cfg.steps:
                avg = _mean(history)
                history = []
                avg.update(step=step, tokens_per_s=seen / (time.perf_counter() - t0))
                bar.set_postfix(loss=f"{avg['loss']:.3f}", acc=f"{avg['acc_first']:.2f}", tau=f"{avg['accept_len']:.2f}")
                with open(log_path, "a") as f:
                    f.write(json.dumps({"split": "train", **avg}) + "\n")
            evaluating = val is not None and (step == self.cfg.steps or (self.cfg.eval_every and
                                                                         step % self.cfg.eval_every == 0))
            if evaluating:
                ev = dict(self.evaluate(params, val), step=step)
                with open(log_path, "a") as f:
                    f.write(json.dumps({"split": "val", **ev}) + "\n")
                self.log(f"step {step}: val loss {ev['loss']:.3f} | first-token acc {ev['acc_first']:.3f} | "
                         f"teacher-forced tau {ev['accept_len']:.2f}")
            if step % self.cfg.save_every == 0 or step == self.cfg.steps:
                self._save(mngr, step, params, opt_state)
        bar.close()
        mngr.wait_until_finished()
        mngr.close()
        return dataclasses.replace(self.drafter, state=params)
