"""The training-throughput levers of issue 13.1, each against a plain reference.

- the reduced loss vocabulary (FR-Spec): logits over the kept rows and the remapped labels give the
  cross-entropy a brute-force NumPy computation gives; labels outside it carry no loss but still
  count as misses in the acceptance metrics;
- the feature store: what it serves is the target's features (bf16-rounded), computed once per row,
  and a new store over the same data resumes from disk without running the target again;
- mixed-precision matmuls: the forward is the bf16 product accumulated in float32, the custom
  gradient equals autodiff of that same product;
- warm start from the target: drafter layer i holds target layer n - L + i.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from bastion_jax.checkpoints import random_drafter
from bastion_jax.testing import tiny_drafter_config
from bastion_jax.training import (FeatureStore, Objective, block_loss, init_from_target, loss_vocab, make_blocks,
                                  matmul, rank_vocab, restrict_vocab, sample_anchors, target_features)
from bastion_jax.training.vocab import VocabError, lm_head_weight


@pytest.fixture(scope="module")
def target(converted):
    return converted("qwen3")[1]


def test_rank_vocab_orders_by_count_then_id():
    ranking = rank_vocab([np.array([3, 3, 1, 5, 5, 5]), {"response_ids": [1, 0]}], 7)
    # counts: 5 -> 3, 3 -> 2, 1 -> 2, 0 -> 1, then the unseen ids 2, 4, 6 by id.
    assert ranking.tolist() == [5, 1, 3, 0, 2, 4, 6]
    with pytest.raises(VocabError, match="outside the vocabulary"):
        rank_vocab([np.array([7])], 7)


def test_reduced_vocabulary_loss_equals_brute_force(target):
    v = target.config.vocab_size
    rng = np.random.default_rng(0)
    ranking = rng.permutation(v).astype(np.int32)
    n_keep = 17
    vocab = loss_vocab(target, ranking, n_keep)
    kept = ranking[:n_keep]
    full = np.asarray(lm_head_weight(target), np.float64)  # [V, h]
    np.testing.assert_array_equal(np.asarray(vocab.head), np.asarray(lm_head_weight(target))[kept])

    # Blocks whose labels are a mix of kept and dropped ids.
    b, s, block = 2, 24, 4
    tokens = rng.choice(np.concatenate([kept, kept, rng.integers(0, v, 8)]), size=(b, s)).astype(np.int32)
    loss_mask = np.zeros((b, s), bool)
    loss_mask[:, 3:] = True
    obj = Objective(block_size=block, num_anchors=5, gamma=3.0, mask_token_id=0)
    anchors, valid = sample_anchors(jax.random.key(1), jnp.asarray(loss_mask), obj.num_anchors)
    blocks = make_blocks(jnp.asarray(tokens), jnp.asarray(loss_mask), anchors, valid, obj)
    hidden = rng.normal(size=blocks.labels.shape + (full.shape[1],)).astype(np.float32)  # [b, N, B-1, h]
    logits = matmul(jnp.asarray(hidden), vocab.head)  # [b, N, B-1, n_keep]
    m = block_loss(logits, restrict_vocab(blocks, vocab.index))

    # Brute force: softmax over the kept rows only, loss on labels inside the kept set.
    lab = np.asarray(blocks.labels)
    w = np.asarray(blocks.weights, np.float64)
    real = np.asarray(blocks.real)
    z = hidden.astype(np.float64) @ full[kept].T  # [b, N, B-1, n_keep]
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    row = {int(t): i for i, t in enumerate(kept)}
    num = den = 0.0
    correct = np.zeros(lab.shape, bool)
    for idx in np.ndindex(lab.shape):
        r = row.get(int(lab[idx]))
        if r is None or w[idx] == 0:
            continue
        num -= w[idx] * logp[idx][r]
        den += w[idx]
    for idx in np.ndindex(lab.shape):
        r = row.get(int(lab[idx]))
        correct[idx] = real[idx] and r is not None and int(np.argmax(z[idx])) == r
    assert den > 0 and any(row.get(int(t)) is None for t in lab[real])  # both kinds of label occur
    np.testing.assert_allclose(float(m.loss), num / den, rtol=1e-5)
    np.testing.assert_allclose(float(m.acc_first), correct[..., 0].sum() / real[..., 0].sum(), rtol=1e-6)
    assert int(m.positions) == int((w > 0).sum()) - sum(
        1 for idx in zip(*np.nonzero(w > 0)) if row.get(int(lab[idx])) is None)


def test_full_vocabulary_is_the_identity(target):
    vocab = loss_vocab(target, None, 0)
    assert vocab.index is None and vocab.head.shape[0] == target.config.vocab_size
    with pytest.raises(VocabError, match="ranking"):
        loss_vocab(target, None, 5)


def test_feature_store_computes_once_and_resumes(target, tmp_path):
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, target.config.vocab_size, (5, 12)).astype(np.int32)
    taps = (0, 1)
    model = nnx.merge(target.graphdef, target.state)
    calls = []

    def compute(t):
        calls.append(len(t))
        # Row by row: a row's features then do not depend on which rows share its batch (XLA:CPU's
        # matmul kernels differ by row count, so batch mates can move the last bit), and stored
        # rows must equal fresh ones bit for bit.
        return jnp.concatenate([target_features(model, jnp.asarray(t[i:i + 1]), taps, jnp.float32)
                                for i in range(len(t))])

    dim = len(taps) * target.config.hidden_size
    want = np.asarray(compute(tokens)).astype(ml_dtypes.bfloat16)  # [5, 12, F]
    calls.clear()
    k1, k2 = {"taps": taps, "target": "a"}, {"taps": taps, "target": "b"}
    store = FeatureStore(tokens, dim, compute, tmp_path, "train", k1)
    got = store.get(np.array([3, 1]))
    np.testing.assert_array_equal(np.asarray(got), want[[3, 1]])
    assert calls == [2] and store.cached == 2
    store.get(np.array([1, 3]))
    assert calls == [2]  # served from the store
    store.get(np.array([0, 3]))
    assert calls == [2, 2] and store.cached == 3
    store.flush()

    again = FeatureStore(tokens, dim, compute, tmp_path, "train", k1)  # a resumed run
    np.testing.assert_array_equal(np.asarray(again.get(np.array([0, 1, 3]))), want[[0, 1, 3]])
    assert calls == [2, 2] and again.cached == 3 and again.reused == 0

    # A grown, reshuffled data set in a new run dir: stored rows are copied by content, new ones computed.
    extra = rng.integers(0, target.config.vocab_size, (2, 12)).astype(np.int32)
    grown = np.concatenate([extra[:1], tokens[[4, 3, 2, 1, 0]], extra[1:]])  # [7, 12]
    want_grown = np.asarray(compute(grown)).astype(ml_dtypes.bfloat16)
    calls.clear()
    reused = FeatureStore(grown, dim, compute, tmp_path / "run2", "train", k1, reuse=[tmp_path])
    assert reused.reused == 3 and reused.cached == 3 and calls == []  # rows 3, 1 and 0 of `tokens`
    np.testing.assert_array_equal(np.asarray(reused.get(np.arange(7))), want_grown)
    assert calls == [7] and reused.cached == 7  # one batch computed the 4 missing rows
    calls[:] = [2, 2]

    other = FeatureStore(tokens, dim, compute, tmp_path, "train", k2)  # other target: nothing reused, stale dropped
    assert other.cached == 0 and other.reused == 0 and len(list(tmp_path.glob("train-*.bin"))) == 1
    uncached = FeatureStore(tokens, dim, compute, None, "train", k1)
    uncached.get(np.array([0]))
    uncached.get(np.array([0]))
    assert calls == [2, 2, 1, 1]


def test_mixed_matmul_forward_and_gradient():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 5, 24)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(7, 24)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(2, 5, 7)), jnp.float32)

    def reference(x, w):  # autodiff of the same bf16 product, no custom rule
        return jnp.einsum("...i,oi->...o", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)

    np.testing.assert_array_equal(np.asarray(matmul(x, w, jnp.bfloat16)), np.asarray(reference(x, w)))
    got = jax.grad(lambda x, w: jnp.sum(matmul(x, w, jnp.bfloat16) * g), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(reference(x, w) * g), argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-2, atol=2e-2)
    f32 = jax.grad(lambda w: jnp.sum(matmul(x, w) * g))(w)  # float32 path: exact autodiff of einsum
    np.testing.assert_allclose(np.asarray(f32), np.einsum("bto,bti->oi", np.asarray(g), np.asarray(x)), rtol=1e-5)


@pytest.mark.parametrize("in_out", [False, True])
def test_init_from_target_copies_the_top_layers(target, in_out):
    """The drafter's layers (HF layout) get the target's top layers, whichever layout the target holds
    its weights in (`weights_in_out`)."""
    from bastion_jax.checkpoints import load_target

    hf = load_target(target.path, jnp.float32, weights_in_out=False)
    target = load_target(target.path, jnp.float32, weights_in_out=in_out)
    cfg = target.config
    drafter = random_drafter(tiny_drafter_config(cfg, num_layers=1, block_size=4), seed=1)
    warm = init_from_target(drafter, target)
    t, d, d0 = (nnx.to_pure_dict(s) for s in (hf.state, warm.state, drafter.state))
    top = t["layers"][cfg.num_hidden_layers - 1]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        np.testing.assert_array_equal(np.asarray(d["layers"][0]["self_attn"][name]["weight"]),
                                      np.asarray(top["self_attn"][name]["weight"]))
    np.testing.assert_array_equal(np.asarray(d["layers"][0]["mlp"]["down_proj"]["weight"]),
                                  np.asarray(top["mlp"]["down_proj"]["weight"]))
    np.testing.assert_array_equal(np.asarray(d["norm"]["weight"]), np.asarray(t["norm"]["weight"]))
    np.testing.assert_array_equal(np.asarray(d["fc"]["weight"]), np.asarray(d0["fc"]["weight"]))  # stays fresh
    np.testing.assert_array_equal(np.asarray(nnx.to_pure_dict(drafter.state)["layers"][0]["self_attn"]["q_proj"]
                                             ["weight"]), np.asarray(d0["layers"][0]["self_attn"]["q_proj"]["weight"]))
    too_deep = random_drafter(tiny_drafter_config(cfg, num_layers=cfg.num_hidden_layers + 1, block_size=4), seed=1)
    with pytest.raises(ValueError, match="layers"):
        init_from_target(too_deep, target)


def test_grow_keeps_the_drafts_and_lets_the_new_layers_learn(target):
    """`grow` (train_drafter --init DIR --layers N): the deeper drafter's hidden states equal the given
    drafter's exactly (the new layers' output projections are zero), its new layers are copies of the
    last one, and the loss's gradient reaches the zeroed projections (so training moves them)."""
    from bastion_jax.training import drafter_blocks, grow

    cfg = tiny_drafter_config(target.config, num_layers=2, block_size=4)
    small = random_drafter(cfg, seed=3)
    big = grow(small, 4)
    assert big.config.num_hidden_layers == 4 and big.config.target_layer_ids == cfg.target_layer_ids
    rng = np.random.default_rng(0)
    b, n, blk, s, h = 1, 3, cfg.block_size, 12, cfg.hidden_size
    emb = jnp.asarray(rng.normal(size=(b, n, blk, h)), jnp.float32)
    anchors = jnp.asarray([[3, 6, 9]], jnp.int32)
    positions = anchors[..., None] + jnp.arange(blk)
    features = jnp.asarray(rng.normal(size=(b, s, len(cfg.target_layer_ids) * cfg.target_hidden_size)), jnp.float32)
    valid = jnp.ones((b, n), bool)

    def hidden(graphdef, state):
        return drafter_blocks(nnx.merge(graphdef, state), emb, positions, anchors, valid, features)

    np.testing.assert_array_equal(np.asarray(hidden(big.graphdef, big.state)),
                                  np.asarray(hidden(small.graphdef, small.state)))
    d = nnx.to_pure_dict(big.state)
    last = nnx.to_pure_dict(small.state)["layers"][1]
    for i in (2, 3):
        np.testing.assert_array_equal(np.asarray(d["layers"][i]["self_attn"]["q_proj"]["weight"]),
                                      np.asarray(last["self_attn"]["q_proj"]["weight"]))
        assert not np.asarray(d["layers"][i]["self_attn"]["o_proj"]["weight"]).any()
        assert not np.asarray(d["layers"][i]["mlp"]["down_proj"]["weight"]).any()
    grads = nnx.to_pure_dict(jax.grad(lambda st: jnp.sum(hidden(big.graphdef, st) ** 2))(big.state))
    for i in (2, 3):
        assert np.abs(np.asarray(grads["layers"][i]["self_attn"]["o_proj"]["weight"])).max() > 0
        assert np.abs(np.asarray(grads["layers"][i]["mlp"]["down_proj"]["weight"])).max() > 0
    assert grow(small, 2) is small
    with pytest.raises(ValueError, match="only grows"):
        grow(big, 3)
    from bastion_jax.train_drafter import build_parser

    with pytest.raises(SystemExit):  # a drafter of 0 layers is refused at the flag, not turned into 2
        build_parser().parse_args(["train", "--data", "d.npz", "--out", "o", "--layers", "0"])


def test_widen_taps_keeps_the_drafts_and_lets_the_new_taps_learn(target):
    """`widen_taps` (train_drafter --init DIR --num-taps N): a drafter reading 3 of 30 target layers,
    widened to DFlash's 5 (which contain its 3), computes the same hidden states from the wider
    features as before from its own taps' columns (the new taps' fc columns are zero), and the
    loss's gradient reaches those columns; a count whose taps miss the drafter's own is refused."""
    import dataclasses

    from bastion_jax.training import drafter_blocks
    from bastion_jax.training.warmstart import widen_taps

    cfg = dataclasses.replace(tiny_drafter_config(target.config, num_layers=2, block_size=4),
                              target_layer_ids=(1, 14, 27), num_target_layers=30)
    narrow = random_drafter(cfg, seed=5)
    wide = widen_taps(narrow, 5)
    assert wide.config.target_layer_ids == (1, 8, 14, 20, 27) and wide.path is None
    rng = np.random.default_rng(1)
    b, s, h = 1, 12, cfg.target_hidden_size
    emb = jnp.asarray(rng.normal(size=(b, 3, cfg.block_size, cfg.hidden_size)), jnp.float32)
    anchors = jnp.asarray([[3, 6, 9]], jnp.int32)
    positions = anchors[..., None] + jnp.arange(cfg.block_size)
    feats = rng.normal(size=(b, s, 5, h)).astype(np.float32)  # per tap of (1, 8, 14, 20, 27)
    valid = jnp.ones((b, 3), bool)

    def hidden(drafter, state, taps):
        return drafter_blocks(nnx.merge(drafter.graphdef, state), emb, positions, anchors, valid,
                              jnp.asarray(feats[:, :, taps].reshape(b, s, -1)))

    np.testing.assert_allclose(np.asarray(hidden(wide, wide.state, [0, 1, 2, 3, 4])),
                               np.asarray(hidden(narrow, narrow.state, [0, 2, 4])), rtol=1e-5, atol=1e-5)
    fc = np.asarray(nnx.to_pure_dict(wide.state)["fc"]["weight"])  # [hidden, 5 h]
    assert not fc[:, h:2 * h].any() and not fc[:, 3 * h:4 * h].any()
    grads = jax.grad(lambda st: jnp.sum(hidden(wide, st, [0, 1, 2, 3, 4]) ** 2))(wide.state)
    assert np.abs(np.asarray(nnx.to_pure_dict(grads)["fc"]["weight"])[:, h:2 * h]).max() > 0
    assert widen_taps(narrow, 3) is narrow
    with pytest.raises(ValueError, match=r"--num-taps 4: .*\[1, 10, 18, 27\].*\[1, 14, 27\]"):
        widen_taps(narrow, 4)
    with pytest.raises(ValueError, match="--num-taps 2"):
        widen_taps(narrow, 2)
