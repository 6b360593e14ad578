"""The DFlash training objective (spec section C) as pure functions of one token batch.

A training sequence x_0..x_{S-1} (prompt + the target's own response) yields many blocks at
once: each random anchor p (response tokens only) becomes a block `[x_p, MASK x (B-1)]` at RoPE
positions p..p+B-1 whose slot k is trained to predict x_{p+k}. Every block sees exactly what it
would see at inference: the target features of positions strictly before its anchor (the root
has no feature yet) and its own block, bidirectionally; never another block.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # DFlash's loss decay per block size (spec C)


def default_gamma(block_size: int) -> float:
    """γ for a block size: the published values, else scaled linearly from γ = 7 at B = 16."""
    return DEFAULT_GAMMA.get(block_size, 7.0 * block_size / 16)


@dataclasses.dataclass(frozen=True)
class Objective:
    block_size: int
    num_anchors: int  # blocks per sequence (fewer valid ones are padded and carry no loss)
    gamma: float
    mask_token_id: int
    # Weight of the soft labels: the target's own next-token law at each label (its logits at the
    # label's previous position, over the loss vocabulary), mixed with the hard label's cross-entropy
    # as (1 - distill) * hard + distill * soft. The hard label of sampled text is one draw of that
    # law; the law itself says what else the target would have accepted.
    distill: float = 0.0
    # Anchors at the positions where the row's chains missed on its last visit (`first_misses`) are
    # drawn this many times as often as others (1: uniform anchors).
    miss_weight: float = 1.0
    # For a drafter with a conditioned head trained with it: the weight of the drafter's own law (its
    # hidden states before the head) in the loss, beside the conditioned law's. Drafting without the
    # head (`--cond-head off`) and a tree's deeper levels read that law, so joint training keeps it.
    # The reported loss is then the sum (not comparable with a run without it).
    marginal: float = 0.0

    def __post_init__(self):
        if self.marginal < 0.0:
            raise ValueError(f"marginal must be >= 0, got {self.marginal}")


class Blocks(NamedTuple):
    """All blocks of a batch, flattened per row to T = n_anchors * block_size slots."""

    ids: jax.Array  # [b, N, B] `[x_p, MASK...]`
    positions: jax.Array  # [b, N, B] p + k
    labels: jax.Array  # [b, N, B-1] x_{p+k} for k = 1..B-1 (a row of the loss vocabulary; -1: outside it)
    weights: jax.Array  # [b, N, B-1] exp(-(k-1)/γ) where the label is real and in the loss vocabulary, else 0
    valid: jax.Array  # [b, N] whether the block has an anchor
    mask: jax.Array  # [b, T, S + T] visibility over [context | blocks]
    real: jax.Array  # [b, N, B-1] the label is a response token (what acceptance metrics count)


def sample_anchors(key: jax.Array, loss_mask: jax.Array, num_anchors: int, prefer: jax.Array | None = None,
                   prefer_weight: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Distinct random anchors per row, ascending: p in [0, S-2] with loss_mask[p] and [p+1].

    loss_mask: [b, S] bool. Returns anchors [b, N] int32 (0 where invalid) and valid [b, N].
    Rows with fewer than N candidates get invalid (padding) blocks.

    prefer: [b, S] bool, positions drawn with weight `prefer_weight` (others 1), sampling without
    replacement by exponential races (Efraimidis-Spirakis: each candidate's time -log(1 - u) / weight,
    the N earliest win); without it the draw is the uniform one.
    """
    b, s = loss_mask.shape
    if not 1 <= num_anchors <= s - 1:
        raise ValueError(f"num_anchors must be in [1, {s - 1}] for sequences of {s} tokens, got {num_anchors}")
    candidate = loss_mask[:, :-1] & loss_mask[:, 1:]  # [b, S-1]
    race = jax.random.uniform(key, candidate.shape)  # [b, S-1]
    if prefer is not None and prefer_weight != 1.0:  # -log(1 - u) is increasing in u: the same order at weight 1
        race = -jnp.log1p(-race) / jnp.where(prefer[:, :-1], prefer_weight, 1.0)
    score = jnp.where(candidate, race, jnp.inf)
    picked = jnp.argsort(score, axis=1)[:, :num_anchors]  # [b, N]: candidates first, random order
    ok = jnp.take_along_axis(candidate, picked, axis=1)
    ordered = jnp.sort(jnp.where(ok, picked, s + picked), axis=1)  # valid ascending, invalid last
    valid = ordered < s
    return jnp.where(valid, ordered, 0).astype(jnp.int32), valid


def first_misses(blocks: Blocks, correct: jax.Array, seq_len: int) -> jax.Array:
    """[b, S] bool: the positions where a block's chain first misses a response token.

    Decoding anchors its next block exactly there (the target's own token, which the drafter got
    wrong, is the new root), so these are the anchors decoding sees, harder than a uniform one:
    after a miss the drafter has only the new root's embedding, not its features.
    correct: [b, N, B-1] `top1_correct`."""
    run = leading_run(correct)  # [b, N]
    k = jnp.minimum(run, correct.shape[-1] - 1)
    missed = blocks.valid & (run < correct.shape[-1]) & jnp.take_along_axis(blocks.real, k[..., None], -1)[..., 0]
    q = jnp.where(missed, blocks.positions[:, :, 0] + 1 + run, seq_len)  # [b, N]; seq_len: none
    rows = jnp.arange(q.shape[0])[:, None]
    return jnp.zeros((q.shape[0], seq_len), bool).at[rows, q].set(True, mode="drop")


def make_blocks(tokens: jax.Array, loss_mask: jax.Array, anchors: jax.Array, valid: jax.Array,
                obj: Objective) -> Blocks:
    """Block inputs, labels, loss weights and the block-sparse mask for anchors [b, N]."""
    b, s = tokens.shape
    n, block = anchors.shape[1], obj.block_size
    k = jnp.arange(block)  # [B]
    positions = anchors[:, :, None] + k  # [b, N, B]
    roots = jnp.take_along_axis(tokens, anchors, axis=1)  # [b, N]
    ids = jnp.where(k == 0, roots[:, :, None], obj.mask_token_id).astype(jnp.int32)
    target_pos = positions[:, :, 1:]  # [b, N, B-1]
    in_seq = target_pos < s
    clipped = jnp.minimum(target_pos, s - 1).reshape(b, -1)
    labels = jnp.take_along_axis(tokens, clipped, axis=1).reshape(b, n, block - 1)
    real = in_seq & jnp.take_along_axis(loss_mask, clipped, axis=1).reshape(b, n, block - 1) & valid[:, :, None]
    decay = jnp.exp(-jnp.arange(block - 1, dtype=jnp.float32) / obj.gamma)  # k-1 = 0..B-2
    weights = jnp.where(real, decay, 0.0)  # [b, N, B-1]
    # Context: a block sees positions strictly before its anchor (invalid blocks see none).
    ctx = jnp.arange(s)[None, None, :] < jnp.where(valid, anchors, 0)[:, :, None]  # [b, N, S]
    ctx = jnp.broadcast_to(ctx[:, :, None, :], (b, n, block, s)).reshape(b, n * block, s)
    same = jnp.repeat(jnp.repeat(jnp.eye(n, dtype=bool), block, axis=0), block, axis=1)  # [T, T]
    mask = jnp.concatenate([ctx, jnp.broadcast_to(same, (b, n * block, n * block))], axis=-1)
    return Blocks(ids, positions.astype(jnp.int32), labels, weights, valid, mask, real)


def restrict_vocab(blocks: Blocks, index: jax.Array | None) -> Blocks:
    """Labels as rows of a reduced loss vocabulary (`index` [V]: target id -> row, or -1 outside).

    Labels outside the kept set get weight 0 (no loss: a drafter restricted to that set can never
    draft them) but stay `real`, so the acceptance metrics count them as misses, as inference would."""
    if index is None:
        return blocks
    labels = jnp.take(index, blocks.labels, axis=0)  # [b, N, B-1]
    return blocks._replace(labels=labels, weights=jnp.where(labels >= 0, blocks.weights, 0.0))


class Metrics(NamedTuple):
    loss: jax.Array  # weighted cross-entropy (the optimised quantity)
    acc_first: jax.Array  # top-1 accuracy of the first drafted token
    accept_len: jax.Array  # mean 1 + leading correct top-1 drafts per block: a teacher-forced chain τ
    weight: jax.Array  # total loss weight (0 means the batch had no trainable block)
    positions: jax.Array  # block positions that carry a loss (nonzero weight): the throughput unit


def top1_correct(logits: jax.Array, blocks: Blocks) -> jax.Array:
    """[b, N, B-1] whether each slot's top-1 draft is its label and a response token (logits [b, N, B-1,
    vocab] over the rows the labels index; labels past the response or outside the vocabulary miss)."""
    return (jnp.argmax(logits, axis=-1) == blocks.labels) & blocks.real


def leading_run(correct: jax.Array) -> jax.Array:
    """[b, N] int32: leading correct drafts per block, what verification would accept of its chain."""
    return jnp.sum(jnp.cumprod(correct.astype(jnp.int32), axis=-1), axis=-1)


def block_loss(logits: jax.Array, blocks: Blocks, teacher: jax.Array | None = None, distill: float = 0.0) -> Metrics:
    """logits: [b, N, B-1, vocab] fp32 for slots 1..B-1 (vocab: the loss vocabulary's rows); teacher:
    the target's logits for the same slots over the same rows (soft labels, weight `distill`)."""
    labels = jnp.maximum(blocks.labels, 0)  # out-of-vocabulary labels (-1) carry weight 0
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [b, N, B-1]
    if teacher is not None and distill > 0:
        soft = optax.softmax_cross_entropy(logits, jax.nn.softmax(jax.lax.stop_gradient(teacher), axis=-1))
        ce = (1.0 - distill) * ce + distill * soft
    total = jnp.sum(blocks.weights)
    loss = jnp.sum(ce * blocks.weights) / jnp.maximum(total, 1e-6)
    correct = top1_correct(logits, blocks)  # [b, N, B-1]
    first_real = blocks.real[..., 0]
    acc_first = jnp.sum(correct[..., 0]) / jnp.maximum(jnp.sum(first_real), 1)
    run = leading_run(correct)  # [b, N]
    accept_len = jnp.sum(jnp.where(first_real, 1 + run, 0)) / jnp.maximum(jnp.sum(first_real), 1)
    return Metrics(loss, acc_first, accept_len, total, jnp.sum(blocks.weights > 0))
