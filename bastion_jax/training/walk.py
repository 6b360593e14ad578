"""Validation along the decoding walk: the drafter's chain tau as greedy decoding would measure it.

Why: the teacher-forced tau of `objective.block_loss` anchors blocks uniformly over whole responses;
decoding anchors each block right after the previous one's first miss, from the first response
token on. On SmolLM2 the uniform figure overstated the engine's dflash tau by 10-20% (gsm8k 2.22 vs
engine 2.03, humaneval 2.09 vs 1.80, `benchmarks/results/cpu-smollm2-drafter-diagnosis.md`), and by
more on long chat rows whose late, formulaic tokens are easy. Walking the per-position runs the way
decoding does reproduced the engine (2.00 / 1.73): that is the figure to select exports by.

How: every response position p of a row's first `window` ones anchors a block (the same blocks the
trainer builds, `objective.make_blocks`, so each equals a real drafting call); `run[p]` = its leading
correct top-1 drafts. Decoding at anchor p commits those drafts and the target's own next token, so
the next anchor is p + 1 + run[p]. A greedy row of the target, walked to its end, takes exactly the
steps `Engine.generate(mode="dflash")` takes on its prompt (`tests/test_training.py`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bastion_jax.training.forward import anchored_forward, matmul
from bastion_jax.training.objective import Objective, leading_run, restrict_vocab, top1_correct
from bastion_jax.training.vocab import LossVocab


def window_anchors(loss_mask: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """Anchors [b, W] = the first `window` positions of each row's response (p with loss_mask[p] and
    [p+1]: a block needs at least one label), and valid [b, W]; invalid anchors are 0 (as
    `objective.sample_anchors` pads)."""
    b, s = loss_mask.shape
    candidate = loss_mask[:, :-1] & loss_mask[:, 1:]  # [b, S-1]
    start = jnp.argmax(candidate, axis=1)  # [b] first response anchor (0 for a row without one)
    anchors = start[:, None] + jnp.arange(window)  # [b, W]
    valid = (anchors < s - 1) & jnp.take_along_axis(candidate, jnp.minimum(anchors, s - 2), axis=1)
    return jnp.where(valid, anchors, 0).astype(jnp.int32), valid


@partial(jax.jit, static_argnames=("drafter_def", "obj", "window", "matmul_dtype", "condition"))
def walk_runs(params, vocab: LossVocab, embed: jax.Array, features: jax.Array, tokens: jax.Array,
              loss_mask: jax.Array, *, drafter_def, obj: Objective, window: int, matmul_dtype: str,
              condition: bool = True) -> tuple[jax.Array, jax.Array]:
    """(run [b, W], valid [b, W]) for the first `window` response anchors of tokens/loss_mask [b, S];
    features [b, S, F] the drafter's taps (with `obj.distill`, followed by the target's final hidden
    states, which are dropped here); `condition` false: drafting without the conditioned head."""
    drafter = nnx.merge(drafter_def, params)
    if obj.distill:
        features = features[..., :-embed.shape[-1]]
    anchors, valid = window_anchors(loss_mask, window)
    hidden, blocks = anchored_forward(drafter, embed, features, tokens, loss_mask, anchors, valid, obj,
                                      matmul_dtype, condition)  # [b, W, B-1, h]
    logits = matmul(hidden, vocab.head, jnp.dtype(matmul_dtype))  # [b, W, B-1, n_vocab]
    return leading_run(top1_correct(logits, restrict_vocab(blocks, vocab.index))), valid


def walk(run: np.ndarray, valid: np.ndarray) -> tuple[int, int]:
    """(tokens, steps) of decoding walks over rows of per-anchor runs [b, W]: from each row's first
    anchor, a step at p commits min(1 + run[p], n - p) tokens (n = the row's valid anchors: the walk
    ends with the window or the response) and moves to p + that."""
    tokens = steps = 0
    for r, ok in zip(np.asarray(run), np.asarray(valid)):
        n = int(np.sum(ok))
        p = 0
        while p < n:
            c = min(1 + int(r[p]), n - p)
            tokens, steps, p = tokens + c, steps + 1, p + c
    return tokens, steps


def rows_per_call(window: int, block_size: int, vocab_rows: int, budget: int = 1 << 27) -> int:
    """Rows per `walk_runs` call so that its logits [rows, W, B-1, vocab] stay within `budget` floats."""
    return max(1, budget // max(1, window * (block_size - 1) * vocab_rows))
