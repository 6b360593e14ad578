"""Soft labels (`--distill`): the teacher is the target's own next-token law at each label, and the loss
mixes it with the hard label's cross-entropy as stated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bastion_jax.checkpoints import random_drafter
from bastion_jax.testing import next_token_logits, tiny_drafter_config
from bastion_jax.training import (Objective, TokenDataset, TrainConfig, Trainer, block_loss, loss_vocab, make_blocks,
                                  restrict_vocab, sample_anchors, target_features, teacher_logits)
from bastion_jax.training.vocab import lm_head_weight


@pytest.fixture(scope="module")
def target(converted):
    return converted("qwen3")[1]


def _blocks(rng, v, b=2, s=20, block=4, anchors=5):
    tokens = rng.integers(0, v, size=(b, s)).astype(np.int32)
    loss_mask = np.zeros((b, s), bool)
    loss_mask[:, 3:] = True
    obj = Objective(block_size=block, num_anchors=anchors, gamma=3.0, mask_token_id=0)
    anchor, valid = sample_anchors(jax.random.key(0), jnp.asarray(loss_mask), obj.num_anchors)
    return tokens, make_blocks(jnp.asarray(tokens), jnp.asarray(loss_mask), anchor, valid, obj)


def test_teacher_logits_are_the_targets_next_token_logits(target):
    """Slot k of the block at anchor p gets the target's logits after tokens[: p + k] (what x_{p+k} is
    drawn from), over the loss vocabulary's rows."""
    rng = np.random.default_rng(0)
    v = target.config.vocab_size
    tokens, blocks = _blocks(rng, v)
    model = nnx.merge(target.graphdef, target.state)
    final = target_features(model, jnp.asarray(tokens), (target.config.num_hidden_layers - 1,), target.dtype)
    ranking = rng.permutation(v).astype(np.int32)
    kept = ranking[:17]
    vocab = loss_vocab(target, ranking, 17)
    teacher = np.asarray(teacher_logits(final, blocks.positions, vocab.head))  # [b, N, B-1, 17]
    full = next_token_logits(target, tokens)  # [b, S, V]: row j predicts token j + 1
    pos = np.asarray(blocks.positions)
    checked = 0
    for i, n, k in np.ndindex(teacher.shape[:3]):
        q = pos[i, n, k + 1]  # the label's position
        if q < tokens.shape[1]:
            np.testing.assert_allclose(teacher[i, n, k], full[i, q - 1, kept], rtol=1e-4, atol=1e-5)
            checked += 1
    assert checked > 20


def test_distill_loss_mixes_hard_and_soft_cross_entropy():
    rng = np.random.default_rng(1)
    v, w = 11, 0.3
    _, blocks = _blocks(rng, v)
    logits = rng.normal(size=blocks.labels.shape + (v,)).astype(np.float32)
    teacher = 2 * rng.normal(size=logits.shape).astype(np.float32)
    m = block_loss(jnp.asarray(logits), restrict_vocab(blocks, None), jnp.asarray(teacher), w)
    hard_only = block_loss(jnp.asarray(logits), restrict_vocab(blocks, None))

    def log_softmax(z):
        z = z.astype(np.float64)
        return z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))

    logp, p_t = log_softmax(logits), np.exp(log_softmax(teacher))
    lab, wt = np.asarray(blocks.labels), np.asarray(blocks.weights, np.float64)
    hard = -np.take_along_axis(logp, lab[..., None], -1)[..., 0]
    soft = -(p_t * logp).sum(-1)
    assert wt.sum() > 0
    np.testing.assert_allclose(float(m.loss), ((1 - w) * hard + w * soft)[wt > 0] @ wt[wt > 0] / wt.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(hard_only.loss), hard[wt > 0] @ wt[wt > 0] / wt.sum(), rtol=1e-5)
    assert float(m.acc_first) == float(hard_only.acc_first)  # the metrics still count hard-label matches


def test_trainer_with_distill_runs_on_the_final_hidden_state(target, tmp_path):
    """The feature store carries the final normed hidden state after the taps; two steps train."""
    drafter = random_drafter(tiny_drafter_config(target.config, num_layers=1, block_size=4), seed=2)
    rng = np.random.default_rng(2)
    rows = [{"prompt_ids": [int(t) for t in rng.integers(4, 90, 4)],
             "response_ids": [int(t) for t in rng.integers(4, 90, 20)]} for _ in range(6)]
    data = TokenDataset(rows, seq_len=24, vocab_size=target.config.vocab_size)
    # no weight decay: what changes the drafter below is the loss's gradient alone
    cfg = TrainConfig(steps=2, batch_size=2, seq_len=24, num_anchors=4, distill=0.5, cache_features=False,
                      weight_decay=0.0)
    trainer = Trainer(target, drafter, cfg, tmp_path, log=lambda m: None)
    store = trainer.feature_store(data, "train")
    h = target.config.hidden_size
    got = np.asarray(store.get(np.arange(2)))
    assert got.shape[-1] == (len(drafter.config.target_layer_ids) + 1) * h
    model = nnx.merge(target.graphdef, target.state)
    final = target_features(model, jnp.asarray(data.tokens[:2]), (target.config.num_hidden_layers - 1,), target.dtype)
    np.testing.assert_allclose(got[..., -h:], np.asarray(final), rtol=1e-5, atol=1e-5)
    before = [np.array(x) for x in jax.tree.leaves(drafter.state)]
    trained = trainer.fit(data, progress=False)
    after = [np.asarray(x) for x in jax.tree.leaves(trained.state)]
    assert len(after) == len(before) and all(np.isfinite(x).all() for x in after)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))  # the two steps trained something
    with pytest.raises(ValueError, match="distill"):
        TrainConfig(steps=1, distill=1.5)
    assert lm_head_weight(target).shape[1] == h
