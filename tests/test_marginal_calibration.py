"""benchmarks/marginal_calibration: the conditional events against brute force, the Platt fit against
known parameters, and the identity calibration leaving the trees as decoding builds them."""

import numpy as np
import pytest

from benchmarks import gate_headroom as gh
from benchmarks import marginal_calibration as mc


def test_conditional_candidates_match_brute_force():
    rng = np.random.default_rng(0)
    n, depth, k = 40, 5, 3
    top_ids = rng.integers(0, 4, size=(n, depth, k))
    top_lp = rng.normal(size=(n, depth, k))
    truth = rng.integers(0, 4, size=(n, depth))
    got = mc.conditional_candidates(top_lp, top_ids, truth)
    for d in range(depth):
        lps, hits = [], []
        for i in range(n):
            if all(truth[i, e] in top_ids[i, e] for e in range(d)):  # every greedy token above d is a candidate
                lps += list(top_lp[i, d])
                hits += [int(top_ids[i, d, j] == truth[i, d]) for j in range(k)]
        assert len(hits) > 0
        np.testing.assert_array_equal(got[d][0], lps)
        np.testing.assert_array_equal(got[d][1], hits)


def test_platt_fit_recovers_known_parameters():
    rng = np.random.default_rng(1)
    p = rng.uniform(0.01, 0.99, size=40_000)
    z = 1.5 * np.log(p / (1 - p)) - 0.4
    hit = rng.uniform(size=p.shape) < 1 / (1 + np.exp(-z))
    a, b = mc.fit_platt(np.log(p), hit)
    assert a == pytest.approx(1.5, abs=0.06) and b == pytest.approx(-0.4, abs=0.06)
    # Already calibrated marginals fit to the identity.
    a, b = mc.fit_platt(np.log(p), rng.uniform(size=p.shape) < p)
    assert a == pytest.approx(1.0, abs=0.05) and b == pytest.approx(0.0, abs=0.05)


def test_identity_calibration_builds_the_decoding_trees(converted):
    import jax.numpy as jnp

    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.presets import tiny_drafter_config

    target = converted("qwen3")[1]
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=6), seed=1)
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4, 8), top_k=4, lookup=None)
    tokens = jnp.asarray(np.arange(3, 35, dtype=np.int32))[None]
    anchors = jnp.arange(4, 20, dtype=jnp.int32)
    raw = gh.tree_pass(engine)(tokens, anchors)
    same = gh.tree_pass(engine, mc.platt(np.tile([1.0, 0.0], (5, 1))))(tokens, anchors)
    np.testing.assert_array_equal(np.asarray(raw.tokens), np.asarray(same.tokens))
    np.testing.assert_allclose(np.asarray(raw.log_probs), np.asarray(same.log_probs), atol=1e-4)
    # A steep calibration does change the scores (the transform is applied).
    steep = gh.tree_pass(engine, mc.platt(np.tile([3.0, 0.0], (5, 1))))(tokens, anchors)
    assert not np.allclose(np.asarray(raw.log_probs), np.asarray(steep.log_probs), atol=1e-3)


def test_calibration_arms_draft_alike_with_a_head(converted):
    """With a conditioned head, both arms draft from the head-free laws (the calibrated ones): the
    identity calibration equals the raw arm, which differs from decoding's trees through the head; a
    transform with the head is refused."""
    import jax.numpy as jnp
    from test_cond_head import with_head

    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.presets import tiny_drafter_config

    target = converted("qwen3")[1]
    drafter = with_head(random_drafter(tiny_drafter_config(target.config, block_size=6), seed=1), 8, seed=5,
                        scale=3.0, recurrent=True)
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4, 8), top_k=4, lookup=None, cond_depths=3)
    tokens = jnp.asarray(np.arange(3, 35, dtype=np.int32))[None]
    anchors = jnp.arange(4, 20, dtype=jnp.int32)
    identity = mc.platt(np.tile([1.0, 0.0], (5, 1)))
    raw = gh.tree_pass(engine, head=False)(tokens, anchors)
    same = gh.tree_pass(engine, identity, head=False)(tokens, anchors)
    np.testing.assert_array_equal(np.asarray(raw.tokens), np.asarray(same.tokens))
    headed = gh.tree_pass(engine)(tokens, anchors)
    assert not np.array_equal(np.asarray(raw.tokens), np.asarray(headed.tokens))
    with pytest.raises(ValueError, match="head=False"):
        gh.tree_pass(engine, identity)
