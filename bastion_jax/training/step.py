"""Drafter training's jitted steps: the DFlash objective + AdamW over cached target features, the
weights' moving average, validation and the target's feature pass (the loop is `trainer.py`).

Where a step's time goes decides the design (SmolLM2-135M target, 2-layer drafter, batch 4 x 320
tokens x 32 anchors of 16 slots on 2 CPU cores; the old step took ~4.7 s): the target forward
(~1.7 s), the LM head over 49,152 tokens forwards and backwards (~1.4 s) and the drafter's
dense masked attention over [context | all blocks] were most of it. So:

- the target runs outside the step, once per sequence: its tap features are kept in a
  `FeatureStore` (a bf16 memmap under the run dir) and later epochs only read them;
- the loss scores a frequency-ranked subset of the vocabulary (FR-Spec, `vocab.py`), the same
  restriction inference applies with `--draft-vocab`;
- each block attends to the context and its own slots only (`forward.drafter_blocks`);
- dense layers may run as bf16 products accumulated in float32 (`matmul_dtype`), with float32
  master weights, norms and softmax.

Only the drafter's parameters are differentiated; the embedding table, the LM-head rows and the
features are step arguments (never closure constants XLA would fold into the executable).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bastion_jax.training.forward import anchored_forward, conditioned, matmul, target_features, teacher_logits
from bastion_jax.training.objective import (Blocks, Objective, block_loss, first_misses, restrict_vocab,
                                            sample_anchors, top1_correct)
from bastion_jax.training.optim import is_head
from bastion_jax.training.vocab import LossVocab


def blocks_forward(drafter, embed: jax.Array, features: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
                   key: jax.Array, obj: Objective, matmul_dtype: str = "float32", prefer: jax.Array | None = None,
                   condition: bool = True) -> tuple[jax.Array, Blocks]:
    """Hidden states [b, N, B-1, h] of slots 1..B-1 of every block of a batch, and the blocks.

    embed: [V, h] the target's embedding table; features: [b, S, F] the rows' target taps; prefer:
    [b, S] positions drawn `obj.miss_weight` times as often as others; condition: through the
    conditioned head (if any)."""
    anchors, valid = sample_anchors(key, loss_mask, obj.num_anchors, prefer, obj.miss_weight)  # [b, N]
    return anchored_forward(drafter, embed, features, tokens, loss_mask, anchors, valid, obj, matmul_dtype,
                            condition)


def _loss(params, drafter_def, vocab: LossVocab, embed, features, tokens, loss_mask, key, obj, matmul_dtype,
          prefer=None):
    """features: [b, S, F] the drafter's taps, followed (with `obj.distill`) by the target's final
    normed hidden states [b, S, h], the soft labels' source. Returns the loss and (metrics, the
    batch's `first_misses` [b, S] where `obj.miss_weight` asks for them, else None)."""
    drafter = nnx.merge(drafter_def, params)
    final = None
    if obj.distill:
        h = embed.shape[-1]
        features, final = features[..., :-h], features[..., -h:]
    dtype = jnp.dtype(matmul_dtype)
    base, blocks = blocks_forward(drafter, embed, features, tokens, loss_mask, key, obj, matmul_dtype, prefer,
                                  condition=False)  # [b, N, B-1, h]
    hidden = conditioned(drafter, embed, base, tokens, blocks.positions, dtype)
    logits = matmul(hidden, vocab.head, dtype)  # [b, N, B-1, n_vocab] float32
    teacher = None if final is None else teacher_logits(final, blocks.positions, vocab.head, dtype)
    blocks = restrict_vocab(blocks, vocab.index)
    metrics = block_loss(logits, blocks, teacher, obj.distill)
    if obj.marginal and drafter.cond_head is not None:  # the head-free law's loss beside it
        own = block_loss(matmul(base, vocab.head, dtype), blocks, teacher, obj.distill)
        metrics = metrics._replace(loss=metrics.loss + obj.marginal * own.loss)
    misses = None
    if obj.miss_weight != 1.0:
        misses = first_misses(blocks, top1_correct(jax.lax.stop_gradient(logits), blocks), tokens.shape[1])
    return metrics.loss, (metrics, misses)


_STATIC = ("drafter_def", "obj", "tx", "matmul_dtype", "head_only")


@partial(jax.jit, static_argnames=_STATIC, donate_argnames=("params", "opt_state"))
def train_step(params, opt_state, vocab: LossVocab, embed, features, tokens, loss_mask, key, prefer=None, *,
               drafter_def, obj: Objective, tx: optax.GradientTransformation, matmul_dtype: str,
               head_only: bool = False):
    """One AdamW step on a batch tokens/loss_mask [b, S] with target features [b, S, F]; prefer [b, S]
    (with `obj.miss_weight`) the rows' misses on their last visit. Returns the new parameters and
    optimizer state, the metrics and this visit's misses (None without `obj.miss_weight`).

    `head_only` (a frozen drafter, `TrainConfig.freeze_drafter`): only the conditioned head is
    differentiated; the drafter's weights enter as constants, so its backward pass is never run
    (their gradients are zeros, which `optim.only_head` zeroes anyway)."""
    def loss(p):
        if head_only:
            p = jax.tree_util.tree_map_with_path(lambda path, x: x if is_head(path) else jax.lax.stop_gradient(x), p)
        return _loss(p, drafter_def, vocab, embed, features, tokens, loss_mask, key, obj, matmul_dtype, prefer)

    grads, (metrics, misses) = jax.grad(loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics, misses


@partial(jax.jit, donate_argnames=("ema",))
def ema_update(ema, params, decay: jax.Array):
    """The moving average of the weights one step on: ema + (1 - decay) (params - ema).

    Why average: a run that continues a trained drafter first loses ground (fresh optimizer moments,
    the warm-up to the peak rate: the held-out walk dipped ~1% early in every CPU pass from v14) and the
    last step is one noisy point of the descent; the average starts at the starting weights and
    moves with the run, so it keeps what the run gains and little of its noise."""
    return jax.tree.map(lambda e, p: e + (1.0 - decay) * (p - e), ema, params)


@partial(jax.jit, static_argnames=("drafter_def", "obj", "matmul_dtype"))
def eval_step(params, vocab: LossVocab, embed, features, tokens, loss_mask, key, *, drafter_def, obj: Objective,
              matmul_dtype: str):
    return _loss(params, drafter_def, vocab, embed, features, tokens, loss_mask, key,
                 dataclasses.replace(obj, miss_weight=1.0), matmul_dtype)[1][0]


@partial(jax.jit, static_argnames=("drafter_def", "obj", "matmul_dtype"))
def misses_step(params, vocab: LossVocab, embed, features, tokens, loss_mask, key, *, drafter_def, obj: Objective,
                matmul_dtype: str):
    """`first_misses` [b, S] of a batch's uniform anchors under `params`, without a gradient: what a
    run marks before its first step, so that every row's first visit already prefers its misses."""
    return _loss(params, drafter_def, vocab, embed, features, tokens, loss_mask, key, obj, matmul_dtype)[1][1]


@partial(jax.jit, static_argnames=("target_def", "tap_layers", "cache_dtype"))
def features_step(target_state, tokens, *, target_def, tap_layers, cache_dtype):
    """The target's tap features for token rows [b, S] (computed once per row; `FeatureStore` keeps them)."""
    return target_features(nnx.merge(target_def, target_state), tokens, tap_layers, cache_dtype)
