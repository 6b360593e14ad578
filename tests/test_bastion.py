"""BASTION tree decoding: AR identity for every policy and bucket, tree-only acceptance,
compaction, lossless sampling through trees, controller and latency model, no recompilation."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bastion_jax import tree_decoding
from bastion_jax.checkpoints import random_drafter
from bastion_jax.controller import Controller, Policy, PolicyError
from bastion_jax.engine import Engine, GenerationError
from bastion_jax.latency import DevicePeaks, LatencyModel, ModelDims
from bastion_jax.modeling.cache import KVCache, causal_mask
from bastion_jax.sampling import SamplingConfig, sampler
from bastion_jax.testing import greedy_continuation, pair_chi_square, tiny_drafter_config, two_token_law

BLOCK = 5
BUCKETS = (1, 4, 8, 16)
PROMPT = [5, 9, 11, 40, 41]


def table_proposal(table, vocab, mode):
    """Drafter logits built from the answer key.

    oracle: the right token has most mass; branch: the right token is only the second choice
    (top-1 is wrong), so only a tree with >= 2 children per node accepts deeply.
    """
    table = jnp.asarray(table)

    def propose(root, start, logits):
        k = jnp.arange(1, logits.shape[1] + 1)
        right = table[jnp.clip(start[:, None] + k[None], 0, table.shape[0] - 1)]  # [b, B-1]
        wrong = (right + 1) % vocab
        out = jnp.full(logits.shape, -10.0)
        if mode == "oracle":
            return out + 10.0 * jax.nn.one_hot(right, vocab)
        return out + 9.9 * jax.nn.one_hot(right, vocab) + 10.0 * jax.nn.one_hot(wrong, vocab)

    return propose


@pytest.mark.parametrize("mode", ["fixed:1", "fixed:4", "fixed:8", "fixed:16", "bastion"])
@pytest.mark.parametrize("arch", ["qwen3", "llama3"])
def test_t0_identical_to_ar_for_every_policy_with_random_drafter(converted, arch, mode):
    _, target = converted(arch)
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK), seed=2)
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=BUCKETS, top_k=4)
    prompts = [PROMPT, [7, 3, 20]]
    ar = engine.generate(prompts, max_new_tokens=24, mode="ar").tokens
    assert engine.generate(prompts, max_new_tokens=24, mode=mode).tokens == ar


@pytest.mark.parametrize("mode", ["fixed:1", "bastion"])
def test_t0_identical_to_ar_with_the_root_as_the_only_bucket(converted, mode):
    """buckets=(1,) leaves trees of the root alone (no node to draft): the tree steps verify it as AR
    does (building such a tree used to crash on an empty candidate list)."""
    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK), seed=2)
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1,), top_k=4)
    prompts = [PROMPT, [7, 3, 20]]
    ar = engine.generate(prompts, max_new_tokens=12, mode="ar").tokens
    result = engine.generate(prompts, max_new_tokens=12, mode=mode)
    assert result.tokens == ar and result.stats.tau == 1.0


@pytest.mark.parametrize("kind,mode,expect_tau", [
    ("oracle", "fixed:16", BLOCK), ("oracle", "fixed:1", 1.0),
    ("branch", "fixed:32", BLOCK), ("branch", "bastion", None),
])
def test_tree_acceptance_with_oracle_and_branch_correct_drafters(converted, kind, mode, expect_tau):
    _, target = converted("qwen3")
    n = 30
    table = greedy_continuation(target, PROMPT, n + BLOCK)
    # top_k=2 and 32 nodes hold the whole binary tree of depth 4 (2 + 4 + 8 + 16 = 30 drafts).
    engine = Engine(target, stop_ids=[-1], block_size=BLOCK, buckets=BUCKETS + (32,), top_k=2,
                    proposal=table_proposal(table, target.config.vocab_size, kind))
    res = engine.generate([PROMPT], max_new_tokens=n, mode=mode)
    assert res.tokens[0] == table[len(PROMPT): len(PROMPT) + n].tolist()
    if expect_tau is not None:
        assert res.stats.tau == pytest.approx(expect_tau)
    else:
        assert res.stats.tau > 1.5  # the controller found deep paths that no chain would
    if kind == "branch":
        chain = Engine(target, stop_ids=[-1], block_size=BLOCK,
                       proposal=table_proposal(table, target.config.vocab_size, kind))
        assert chain.generate([PROMPT], max_new_tokens=n, mode="dflash").stats.tau == 1.0


def test_compaction_equals_sequential_cache(converted):
    """After a tree step, the committed slots of the cache equal those of a plain causal pass."""
    _, target = converted("llama3")
    n = 12
    table = greedy_continuation(target, PROMPT, n + BLOCK)
    engine = Engine(target, stop_ids=[-1], block_size=BLOCK, buckets=(16,), top_k=4,
                    proposal=table_proposal(table, target.config.vocab_size, "branch"))
    prefill, steps = engine.executables.tree(1, 16, 64, [16])
    tcache = engine.executables.new_cache(1, 64)
    padded = np.zeros((1, 16), np.int32)
    padded[0, : len(PROMPT)] = PROMPT
    state, _ = prefill(engine.executables.target_params, None, tcache, KVCache(k=(), v=()), jnp.asarray(padded),
                       jnp.array([len(PROMPT)]), sampler(jax.random.PRNGKey(0), SamplingConfig()))
    state, out, _ = steps[16](engine.executables.target_params, None, state, jnp.array([True]),
                              sampler(jax.random.PRNGKey(1), SamplingConfig()))
    length = int(state.length[0])
    # Root + >= 2 accepted second-choice drafts: they sat at scattered node slots, so the
    # compaction really moved K/V.
    assert length >= len(PROMPT) + 3
    model = nnx.merge(target.graphdef, target.state)
    seq = table[:length]
    ref = KVCache.create(target.config, 1, 64, jnp.float32)
    zero = jnp.zeros(1, jnp.int32)
    ref = model(jnp.asarray(seq[None]), jnp.arange(length)[None], ref, zero, causal_mask(zero.shape[0], length)).cache
    for got, want in ((state.target_cache.k, ref.k), (state.target_cache.v, ref.v)):  # [layers, b, kv, slots, d]
        np.testing.assert_allclose(np.asarray(got)[:, 0, :, :length], np.asarray(want)[:, 0, :, :length], atol=1e-5)


def test_sampling_through_trees_matches_target_distribution(vocab6_target):
    target, prompt = vocab6_target, [1, 4, 3]
    joint = two_token_law(target, prompt)
    # The drafter's marginal at slot 1 is the target's conditional averaged over roots: the tree
    # holds several children per node, so acceptance is frequent and a biased rule would show.
    marg = jnp.asarray(np.log(joint.sum(0) + 1e-9))

    def propose(root, start, logits):
        return jnp.broadcast_to(marg, logits.shape)

    engine = Engine(target, stop_ids=[-1], block_size=3, buckets=(4,), top_k=3, proposal=propose)
    res = engine.generate([prompt] * 6000, max_new_tokens=2, mode="fixed:4", sampling=SamplingConfig(1.0), seed=3)
    assert res.stats.tau > 1.3
    assert pair_chi_square(res.tokens, joint) < 80.0  # ~35 dof: p < 1e-4 for a correct sampler


def test_no_recompilation_after_warmup_bastion(converted):
    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK))
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=BUCKETS, top_k=4)
    engine.generate([PROMPT], max_new_tokens=10, mode="bastion")
    n = engine.compilations
    # prefill + one step per bucket but 1 (the root alone is a root step) + the root (AR) step: hold,
    # draft, flush + the steps verifying a held lookup chain without drafting (buckets 2..block size)
    assert n == 1 + (len(BUCKETS) - 1) + 3 + sum(1 < b <= BLOCK for b in BUCKETS)
    assert not any(k[0] == "tree_step" and k[-1] == 1 for k in engine.executables._table)
    res = engine.generate([[4, 4, 4]], max_new_tokens=10, mode="bastion")
    assert engine.compilations == n and res.stats.compilations == 0
    assert res.stats.compilations_after_warmup == 0
    engine.generate([PROMPT], max_new_tokens=10, mode="fixed:1")  # fixed:1 does run a one-node tree step
    assert any(k[0] == "tree_step" and k[-1] == 1 for k in engine.executables._table)


def test_calibration_prices_the_root_alone_as_the_drafting_root_step(converted):
    """bastion never runs bucket 1 as a tree step (a root step that drafts is the same work), so the
    calibration neither compiles nor times it and prices it as that root step."""
    from bastion_jax.latency import AR_DRAFT, held

    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK))
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=BUCKETS, top_k=4)
    samples = engine.calibrate(64, contexts=(8, 40), reps=1)
    chains = {held(b) for b in BUCKETS if 1 < b <= BLOCK}  # the steps verifying a held lookup chain
    assert chains and {b for b, _, _ in samples} == (set(BUCKETS) - {1}) | {"ar", AR_DRAFT} | chains
    assert not any(k[0] == "tree_step" and k[-1] == 1 for k in engine.executables._table)
    for c in (8, 40):
        assert engine.latency.predict(1, c) == pytest.approx(engine.latency.predict(AR_DRAFT, c))


def test_latency_model_prices_bucket_one_as_the_drafting_root_step_only_with_a_drafter():
    """With a drafter, bucket 1 and the drafting root step are one variant: one fit (a one-node tree
    step's timings, which the profiler reports, fit nothing), one online correction. Without one,
    bucket 1 is a tree step of its own."""
    from bastion_jax.latency import AR_DRAFT

    dims = ModelDims(layers=2, hidden=64, n_q=4, n_kv=2, head_dim=16, ffn=128, vocab=96)
    lat = LatencyModel(dims, DevicePeaks("test", 1e12, 1e11), (1, 8), drafter=dims, block_size=4)
    lat.fit([(AR_DRAFT, c, 0.02 + 1e-5 * c) for c in (16, 512)] + [(1, c, 0.5) for c in (16, 512)])
    assert lat.predict(1, 100) == pytest.approx(0.021)
    lat.observe(1, 100, 2 * 0.021)  # a drafting root step, as the loop may report it
    assert lat.predict(AR_DRAFT, 100) == pytest.approx(2 ** 0.1 * 0.021)
    assert lat.predict(1, 100) == lat.predict(AR_DRAFT, 100)
    plain = LatencyModel(dims, DevicePeaks("test", 1e12, 1e11), (1, 8))  # no drafter
    plain.fit([(1, c, 3 * plain.raw(1, c) + 0.1) for c in (16, 512)])
    assert plain.predict(1, 100) == pytest.approx(3 * plain.raw(1, 100) + 0.1)
    plain.observe(1, 100, 1.0)
    assert plain.predict(AR_DRAFT, 100) != plain.predict(1, 100)


def test_a_tree_step_that_holds_is_priced_by_its_own_fit_once_profiled():
    """A step that verifies b nodes and does not draft (a held lookup chain) is its own variant: once
    calibrated, the gate's T(b, c, no draft) is that fit (and its online correction), not the drafting
    step minus a draft's price; before, the difference stands in."""
    from bastion_jax.latency import AR, AR_DRAFT, held, held_bucket

    dims = ModelDims(layers=2, hidden=64, n_q=4, n_kv=2, head_dim=16, ffn=128, vocab=96)
    lat = LatencyModel(dims, DevicePeaks("test", 1e12, 1e11), (1, 8), drafter=dims, block_size=4)
    for b, t in ((AR, 0.020), (AR_DRAFT, 0.025), (8, 0.040)):  # flat fits: seconds at any context
        lat.alpha[b], lat.beta[b] = 0.0, t
    assert lat.step_time(8, 100, False) == pytest.approx(0.035)  # 0.040 - (0.025 - 0.020)
    lat.fit([(held(8), c, 3 * lat.raw(held(8), c)) for c in (16, 512)])
    assert held_bucket(held(8)) == 8 and held_bucket(AR) is None and held_bucket(8) is None
    assert lat.raw(held(8), 100) == pytest.approx(lat.raw(8, 100) - lat.draft_raw(100))  # no draft in it
    want = 3 * lat.raw(held(8), 100)
    assert lat.step_time(8, 100, False) == pytest.approx(want)
    assert lat.step_time(8, 100, True) == pytest.approx(0.040)
    lat.observe(held(8), 100, 2 * want)
    assert lat.step_time(8, 100, False) == pytest.approx(2 ** 0.1 * want)
    assert lat.predict(8, 100) == pytest.approx(0.040)  # the drafting step's price is its own
    saved = LatencyModel(dims, DevicePeaks("test", 1e12, 1e11), (1, 8), drafter=dims, block_size=4)
    lat.ema.clear()
    assert saved.load_json(lat.to_json("m", "float32", 4), "m", "float32", 4)
    assert saved.step_time(8, 100, False) == pytest.approx(want)


def test_fixed_policy_with_unknown_bucket_is_an_error(converted):
    _, target = converted("qwen3")
    engine = Engine(target, stop_ids=[-1], block_size=BLOCK, buckets=BUCKETS,
                    proposal=lambda r, s, logits: logits)
    with pytest.raises(GenerationError, match="unknown bucket 12"):
        engine.generate([PROMPT], max_new_tokens=4, mode="fixed:12")
    with pytest.raises(GenerationError, match="unknown mode"):
        engine.generate([PROMPT], max_new_tokens=4, mode="tree")


def test_a_tree_step_refuses_a_bucket_it_was_not_configured_for(converted):
    """The state holds a tree of max(buckets) nodes; a step asked for more (or for a size between the
    buckets) is refused when traced instead of silently verifying a clamped slice."""
    _, target = converted("qwen3")
    engine = Engine(target, stop_ids=[-1], block_size=BLOCK, buckets=BUCKETS,
                    proposal=lambda r, s, logits: logits)
    cfg = engine.executables.config()
    _, *args = engine.executables._tree_step_args(cfg, 1, 64)
    jax.eval_shape(partial(tree_decoding.tree_step, cfg, bucket=8), *args)  # a configured bucket traces
    for bad in (12, 32, 0):
        with pytest.raises(ValueError, match=f"unknown bucket {bad}"):
            jax.eval_shape(partial(tree_decoding.tree_step, cfg, bucket=bad), *args)


def test_controller_picks_bucket_maximising_tokens_per_second():
    dims = ModelDims(layers=2, hidden=64, n_q=4, n_kv=2, head_dim=16, ffn=128, vocab=96, bytes_per_value=4)
    lat = LatencyModel(dims, DevicePeaks("test", 1e12, 1e11), (1, 4, 16))
    lat.alpha.update({1: 0.0, 4: 0.0, 16: 0.0})
    lat.beta.update({1: 1.0, 4: 1.5, 16: 4.0})  # seconds per step, independent of context
    ctl = Controller(Policy.parse("bastion"), (1, 4, 16), lat)
    active = np.array([True])
    # A(b): 0, 2, 2.5 -> tokens/s 1/1, 3/1.5, 3.5/4: bucket 4 wins.
    assert ctl.choose(np.array([[0.0, 2.0, 2.5]]), 100, active) == 4
    # Deep trees pay off when A(16) is large: 13/4 > 3/1.5.
    assert ctl.choose(np.array([[0.0, 2.0, 12.0]]), 100, active) == 16
    assert dict(ctl.histogram) == {4: 1, 16: 1}
    with pytest.raises(PolicyError, match="unknown bucket"):
        Controller(Policy.parse("fixed:8"), (1, 4, 16), lat)


def test_a_batch_is_judged_by_the_rows_that_may_end_it():
    """A batch ends with its last row: a step is judged by the rows that may be last after it (fewer
    than a block ahead of the row with most tokens left), by the least of their curves, not the mean.
    Brute force over every step's committed counts checks `last_rows`."""
    from bastion_jax.controller import batch_curve, last_rows

    curves = np.array([[0.0, 3.0, 5.0], [0.0, 0.2, 0.3], [0.0, 2.0, 9.0]])
    every = np.array([True, True, True])
    np.testing.assert_allclose(batch_curve(curves[:1], every[:1]), curves[0])  # one row: its own
    np.testing.assert_allclose(batch_curve(curves, last_rows(every, np.array([40, 40, 40]), 16)), [0.0, 0.2, 0.3])
    # Row 1 is a whole block ahead (it cannot be last after the step); an ended row never counts.
    rows = last_rows(every, np.array([40, 24, 40]), 16)
    assert rows.tolist() == [True, False, True]
    np.testing.assert_allclose(batch_curve(curves, rows), [0.0, 2.0, 5.0])
    assert last_rows(every, np.array([40, 25, 40]), 16).tolist() == [True, True, True]
    assert last_rows(np.array([True, False, True]), np.array([10, 40, 30]), 16).tolist() == [False, False, True]
    assert last_rows(every, None, 16).tolist() == [True] * 3 and last_rows(every, np.array([9, 1, 1]), 0).all()
    rng = np.random.default_rng(0)
    for _ in range(300):
        remaining = rng.integers(1, 40, 4)
        active = rng.random(4) < 0.8
        if not active.any():
            continue
        rows = last_rows(active, remaining, 8)
        for _ in range(20):  # any step (1..8 tokens a row): its last row is one of `rows`
            after = np.where(active, remaining - rng.integers(1, 9, 4), -999)
            assert rows[int(np.argmax(after))] and rows[after == after.max()].all()


def test_controller_sizes_a_batchs_tree_for_its_last_row():
    """One predictable row and one that accepts nothing: a tree step costs its price for both rows, and
    the batch's end comes no sooner, so bastion takes the root alone (a mean over rows drafted)."""
    dims = ModelDims(layers=2, hidden=64, n_q=4, n_kv=2, head_dim=16, ffn=128, vocab=96, bytes_per_value=4)
    lat = LatencyModel(dims, DevicePeaks("test", 1e12, 1e11), (1, 4, 16))
    lat.alpha.update({1: 0.0, 4: 0.0, 16: 0.0})
    lat.beta.update({1: 1.0, 4: 1.5, 16: 4.0})
    ctl = Controller(Policy.parse("bastion"), (1, 4, 16), lat)
    curves = np.array([[0.0, 3.0, 12.0], [0.0, 0.1, 0.2]])
    both = np.array([True, True])
    assert ctl.choose(curves, 100, both) == 1
    # The hard row is 20 tokens ahead (it can't be last, `last_rows`): the other sizes the tree alone.
    assert ctl.choose(curves, 100, np.array([True, False])) == 16
    assert ctl.choose(curves[:1], 100, both[:1]) == 16


def test_online_correction_shrugs_off_an_outlier_and_follows_a_steady_error():
    dims = ModelDims(layers=2, hidden=64, n_q=4, n_kv=2, head_dim=16, ffn=128, vocab=96)
    lat = LatencyModel(dims, DevicePeaks("test", 1e12, 1e11), (1, 8))
    fitted = lat.predict(8, 512)
    lat.observe(8, 512, 9 * fitted)  # an executable's first, cold run
    assert lat.predict(8, 512) < 1.1 * fitted
    for _ in range(10):
        lat.observe(8, 512, fitted)
    assert lat.predict(8, 512) == pytest.approx(fitted, rel=0.03)
    for _ in range(120):  # the step really takes 5x what was fitted
        lat.observe(8, 512, 5 * fitted)
    assert lat.predict(8, 512) == pytest.approx(5 * fitted, rel=0.01)
    assert lat.predict(1, 512) == LatencyModel(dims, DevicePeaks("test", 1e12, 1e11), (1, 8)).predict(1, 512)


def test_latency_fit_recovers_linear_calibration_and_persists(tmp_path):
    dims = ModelDims(layers=2, hidden=64, n_q=4, n_kv=2, head_dim=16, ffn=128, vocab=96)
    lat = LatencyModel(dims, DevicePeaks("test", 1e12, 1e11), (1, 8))
    samples = [(b, c, 3.0 * lat.raw(b, c) + 0.002) for b in (1, 8) for c in (64, 512, 2048)]
    lat.fit(samples)
    for b, c, t in samples:
        assert lat.predict(b, c) == pytest.approx(t, rel=1e-6)
    fitted = lat.predict(8, 512)
    lat.save(tmp_path / "cal.json", "tiny", "float32", 4)  # the offline fit is what gets saved
    lat.observe(8, 512, 2 * fitted)  # online: a slower measurement moves the correction (log-space EMA)
    assert lat.ema[8] == pytest.approx(2.0 ** 0.1) and lat.predict(8, 512) == pytest.approx(2.0 ** 0.1 * fitted)
    with pytest.raises(ValueError, match="online"):  # an EMA-corrected model never overwrites a calibration
        lat.save(tmp_path / "cal.json", "tiny", "float32", 4)
    fresh = LatencyModel(dims, DevicePeaks("test", 1e12, 1e11), (1, 8))
    assert fresh.load(tmp_path / "cal.json", "tiny", "float32", 4)
    assert fresh.predict(8, 512) == pytest.approx(fitted)
    other = LatencyModel(dims, DevicePeaks("test", 1e12, 1e11), (1, 8, 16))  # other bucket set: not reused
    assert not other.load(tmp_path / "cal.json", "tiny", "float32", 4)
    assert not fresh.load(tmp_path / "cal.json", "tiny", "float32", 8)  # other tree width: not reused
