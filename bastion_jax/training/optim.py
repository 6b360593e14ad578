"""What a drafter training run is (`TrainConfig`) and its optimiser: AdamW with the DFlash schedule,
whose learning rate the loop sets each step so that a run cut by wall time still anneals."""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

import jax
import jax.numpy as jnp
import optax

MATMUL_DTYPES = ("float32", "bfloat16")


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
    # A checkpoint also once this many minutes passed since the last one (0: steps only): 200 steps
    # are 17 minutes on 2 CPU cores and 14 seconds on an H200, and a session can end at any minute.
    save_minutes: float = 5.0
    eval_every: int = 0  # 0: only at the end
    draft_vocab: int = 0  # loss over the N most frequent tokens of the ranking (0: the full vocabulary)
    matmul_dtype: str = "float32"  # "bfloat16": dense-layer products in bf16, accumulated in float32
    cache_features: bool = True  # keep target features under workdir/features (computed once per sequence)
    distill: float = 0.0  # weight of the target's soft labels in the loss (`Objective.distill`)
    # Validation walks the first `walk_window` response positions of `walk_rows` held-out rows the way
    # decoding does (`walk.py`): the tau that selects the best step (0 rows: the teacher-forced tau).
    walk_rows: int = 32
    walk_window: int = 96
    # Weights averaged over the run (`ema_update`): 0 = off; else the decay of an exponential moving
    # average that starts at the starting weights and is what validation, `best/` and the export read.
    ema: float = 0.0
    # Anchors where a row's chains first missed on its last visit are drawn this many times as often
    # (`Objective.miss_weight`): decoding anchors there, after a token the drafter got wrong. 1: uniform.
    miss_weight: float = 1.0
    # Train only the drafter's conditioned head (`modeling/cond_head.py`); every other weight stays as
    # it is (no gradient, no weight decay).
    freeze_drafter: bool = False
    # With a head trained together with its drafter: the weight of the drafter's own (head-free) law's
    # loss beside the conditioned one (`Objective.marginal`; 0: the conditioned loss alone).
    marginal: float = 0.0

    def __post_init__(self):
        # Each message names the field and its train_drafter flag: the CLI reports it as its one error
        # line before the data loads (a zero --log-every used to divide by zero after the first compile).
        for name in ("steps", "batch_size", "log_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_named(name)} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:  # (a negative one was taken as its absolute value by the step modulo)
            raise ValueError(f"{_named('eval_every')} must be >= 0 (0: validate only at the end), "
                             f"got {self.eval_every}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"{_named('lr')} must be a finite number > 0, got {self.lr}")
        if self.gamma is not None and not (math.isfinite(self.gamma) and self.gamma > 0):  # None: the block's default
            raise ValueError(f"{_named('gamma')} must be a finite number > 0 (leave it out for the block size's "
                             f"default), got {self.gamma}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"{_named('warmup_ratio')} must be in [0, 1), got {self.warmup_ratio}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"{_named('weight_decay')} must be a number >= 0, got {self.weight_decay}")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):  # 0 would clip every update away
            raise ValueError(f"{_named('max_grad_norm')} must be a number > 0, got {self.max_grad_norm}")
        if not (math.isfinite(self.save_minutes) and self.save_minutes >= 0):
            raise ValueError(f"{_named('save_minutes')} must be a number >= 0 (0: by steps only), "
                             f"got {self.save_minutes}")
        if not 1 <= self.num_anchors < self.seq_len:
            raise ValueError(f"num_anchors must be in [1, seq_len), got {self.num_anchors} for seq_len {self.seq_len}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0 = the full vocabulary), got {self.draft_vocab}")
        if not 0.0 <= self.distill <= 1.0:
            raise ValueError(f"distill must be in [0, 1], got {self.distill}")
        if self.walk_rows < 0 or self.walk_window < 1:
            raise ValueError(f"walk_rows must be >= 0 and walk_window >= 1, got {self.walk_rows}, {self.walk_window}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema must be in [0, 1) (0 = off), got {self.ema}")
        if not self.miss_weight > 0.0:
            raise ValueError(f"miss_weight must be > 0 (1 = uniform anchors), got {self.miss_weight}")
        if self.marginal < 0.0:
            raise ValueError(f"marginal must be >= 0, got {self.marginal}")
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"matmul_dtype must be one of {', '.join(MATMUL_DTYPES)}, got {self.matmul_dtype!r}")


def _named(field: str) -> str:
    """`field` with the train_drafter flag that sets it, for error messages read by CLI and library users alike."""
    return f"{field} (--{field.replace('_', '-')})"


@lru_cache(maxsize=8)  # built once per config, evaluated every step
def schedule(cfg: TrainConfig) -> optax.Schedule:
    """The DFlash schedule over `cfg.steps`: linear warm-up over `warmup_ratio`, cosine decay to 10%."""
    warmup = max(1, int(round(cfg.warmup_ratio * cfg.steps)))
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), cfg.lr * 0.1)


def learning_rate(cfg: TrainConfig, progress: float) -> float:
    """`schedule` at `progress` in [0, 1] of the run. Progress is steps done / `steps`, or, for a run
    with a wall-time limit, the larger of that and the time used, so a run cut by time still anneals."""
    return float(schedule(cfg)(min(max(progress, 0.0), 1.0) * cfg.steps))


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW (global-norm clipping first) whose learning rate is a state input the loop sets each
    step from `learning_rate`: the schedule can follow wall time as well as steps."""
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, b1=0.9, b2=0.95,
                                                  weight_decay=cfg.weight_decay)
    if cfg.freeze_drafter:  # gradients and updates (decay included) of everything else zeroed
        return optax.chain(only_head(), optax.clip_by_global_norm(cfg.max_grad_norm), adamw, only_head())
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)


def is_head(path: tuple) -> bool:
    """Whether a parameter's tree path lies in the drafter's conditioned head."""
    return bool(path) and getattr(path[0], "key", None) == "cond_head"


def only_head() -> optax.GradientTransformation:
    """Zeroes the updates of every parameter outside the conditioned head (stateless)."""

    def update(updates, state, params=None):
        return jax.tree_util.tree_map_with_path(lambda p, u: u if is_head(p) else jnp.zeros_like(u), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def set_learning_rate(opt_state, lr: float):
    """`opt_state` (of `optimizer`) with its injected learning rate set to `lr`."""
    return tuple(s._replace(hyperparams={**s.hyperparams, "learning_rate": jnp.asarray(lr, jnp.float32)})
                 if hasattr(s, "hyperparams") else s for s in opt_state)
