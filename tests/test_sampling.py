"""Sampling rules: the empirical distribution of `sample` equals the filtered softmax; the prefiltered
top-k / top-p equal a full sort on a real-sized vocabulary, including past the prefilter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.sampling import PREFILTER, SamplingConfig, argmax, filter_logits, sample, sampler
from bastion_jax.testing import filtered_probs

LOGITS = jnp.log(jnp.array([0.05, 0.4, 0.25, 0.2, 0.1]))


def expected_probs(cfg: SamplingConfig) -> np.ndarray:
    p = np.exp(np.asarray(LOGITS, np.float64) / cfg.temperature)
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    if cfg.top_k:
        keep[order[: cfg.top_k]] = True
    else:
        keep[:] = True
    if cfg.top_p < 1.0:
        nucleus = np.zeros_like(p, bool)
        mass = 0.0
        for i in order:
            if mass >= cfg.top_p:
                break
            nucleus[i] = True
            mass += p[i]
        keep &= nucleus
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("cfg", [SamplingConfig(1.0), SamplingConfig(0.7), SamplingConfig(1.0, top_k=2),
                                 SamplingConfig(1.0, top_p=0.6), SamplingConfig(2.0, top_k=3, top_p=0.8)])
def test_sample_distribution_matches_filtered_softmax(cfg):
    n = 20000
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    draws = np.asarray(jax.vmap(lambda k: sample(LOGITS, sampler(k, cfg)))(keys))
    counts = np.bincount(draws, minlength=5)
    exp = expected_probs(cfg) * n
    assert (counts[exp == 0] == 0).all(), "a filtered-out token was sampled"
    m = exp > 0
    chi2 = (((counts[m] - exp[m]) ** 2) / exp[m]).sum()
    assert chi2 < 20.0, (counts, exp)  # df <= 4: p < 1e-3 for a correct sampler


def test_filter_keeps_probabilities_of_kept_tokens():
    out = np.asarray(jax.nn.softmax(filter_logits(LOGITS, sampler(jax.random.PRNGKey(0), SamplingConfig(1.0, top_k=2)))))
    np.testing.assert_allclose(out, [0, 0.4 / 0.65, 0.25 / 0.65, 0, 0], atol=1e-6)


def test_temperature_zero_is_argmax_inside_one_compiled_function():
    """Greedy is a traced branch: one jitted `sample` takes the argmax at temperature 0 (whatever the
    key and filters) and draws at temperature > 0 (seen to fail with the branches swapped)."""
    logits = jnp.log(jnp.array([[0.3, 0.36, 0.34], [0.5, 0.2, 0.3]]))  # near-flat: draws often differ
    pick = jax.jit(sample)
    keys = jax.random.split(jax.random.PRNGKey(0), 64)
    greedy = {tuple(np.asarray(pick(logits, sampler(k, SamplingConfig(0.0, top_k=2))))) for k in keys}
    drawn = {tuple(np.asarray(pick(logits, sampler(k, SamplingConfig(1.0))))) for k in keys}
    assert greedy == {(1, 0)}
    assert len(drawn) > 3
    assert pick._cache_size() == 1  # (one compiled function for both)
    with pytest.raises(TypeError, match="Sampler"):
        sample(LOGITS, jax.random.PRNGKey(0))  # a step samples with its parameters, not a bare key


@pytest.mark.parametrize("vocab", [7, 1024, 2048, 5000, 49152])
def test_two_pass_argmax_equals_argmax(vocab):
    """First index of the maximum, ties included (small integers tie often), whole blocks or a tail."""
    rng = np.random.default_rng(vocab)
    for x in (rng.integers(0, 3, size=(4, vocab)), rng.normal(size=(2, 3, vocab))):
        x = x.astype(np.float32)
        np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(jnp.asarray(x))), x.argmax(-1))
    x = np.zeros((3, 5000), np.float32)
    x[0, [4000, 4999]] = 1  # a tie between the last block and the tail: the earlier index
    x[1, 4990] = 1  # the maximum in the tail
    x[2, [3, 2047]] = 1  # a tie across blocks
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(x), chunk=1024)), [4000, 4990, 3])


def test_inverse_cdf_draws_follow_the_law_across_blocks():
    """`draw` over several 1,024-logit blocks (and a padded tail): zero-probability tokens between and
    around the live ones are never drawn, and the counts follow softmax (chi-square, df 7)."""
    from bastion_jax.sampling import draw

    vocab, live = 2100, np.array([0, 5, 1023, 1024, 1500, 2047, 2048, 2099])
    z = np.full(vocab, -np.inf, np.float32)
    z[live] = np.log([0.05, 0.2, 0.1, 0.15, 0.02, 0.08, 0.3, 0.1])
    n = 8000
    rows = jnp.broadcast_to(jnp.asarray(z), (2, n // 2, vocab))  # [b, nodes, vocab], as a tree step draws
    got = np.asarray(jax.jit(draw)(rows, jax.random.PRNGKey(1))).ravel()
    counts = np.bincount(got, minlength=vocab)
    assert counts[np.setdiff1d(np.arange(vocab), live)].sum() == 0
    exp = np.exp(z[live]) / np.exp(z[live]).sum() * n
    assert (((counts[live] - exp) ** 2) / exp).sum() < 24.3  # df 7: p < 1e-3 for a correct draw


def test_bisection_cuts_equal_the_sorted_ones():
    """The k-th largest logit and the top-p threshold found by bisection over the float bit order equal
    what a full sort gives: ties, negative and -inf logits, k at both ends, p from tiny to ~1."""
    from bastion_jax.sampling import _kth_largest, _nucleus, _nucleus_cut

    rng = np.random.default_rng(5)
    z = rng.normal(size=(5, 3000)).astype(np.float32) * 4
    z[1] = np.round(z[1])  # many ties
    z[2, :1000] = -np.inf  # a top-k cut before the nucleus
    z[3] -= 1e4  # all negative, far from zero
    z = jnp.asarray(z)
    desc = -np.sort(-np.asarray(z), axis=-1)
    for k in (1, 2, 257, 1999, 2000):
        np.testing.assert_array_equal(np.asarray(_kth_largest(z, jnp.int32(k)))[:, 0], desc[:, k - 1])
    for p in (1e-4, 0.3, 0.9, 0.999):
        want = np.asarray(_nucleus(jnp.asarray(desc), z, jnp.float32(p))[0])
        np.testing.assert_array_equal(np.asarray(jax.jit(_nucleus_cut)(z, jnp.float32(p))), want)


def test_a_rows_cut_does_not_depend_on_its_batch():
    """A peaked row filtered alone or beside a flat row (whose nucleus sends the batch to the bisection)
    keeps the same tokens, at top-p values equal to its own prefix masses (rounding ties)."""
    rng = np.random.default_rng(11)
    peaked = rng.normal(0, 4, 3000).astype(np.float32)
    flat = rng.normal(0, 0.3, 3000).astype(np.float32)
    z = jnp.asarray(peaked)
    masses = np.asarray(jnp.cumsum(jnp.exp(-jnp.sort(-z) - jax.nn.logsumexp(z))))[:24]  # the prefilter's sums
    cut = jax.jit(filter_logits)
    for p in masses[masses < 0.999]:
        s = sampler(jax.random.PRNGKey(0), SamplingConfig(1.0, top_p=float(p)))
        alone, paired = cut(jnp.asarray(peaked[None]), s)[0], cut(jnp.asarray(np.stack([peaked, flat])), s)[0]
        np.testing.assert_array_equal(np.isfinite(np.asarray(alone)), np.isfinite(np.asarray(paired)))


def test_invalid_sampling_config():
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(1.0, top_p=0.0)
    # NaN compares false with everything: it used to pass and decode 256 tokens of garbage.
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            SamplingConfig(bad)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(1.0, top_p=float("nan"))
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(1.0, top_k=-1)


@pytest.mark.parametrize("cfg", [
    SamplingConfig(1.0, top_k=40), SamplingConfig(1.0, top_k=3 * PREFILTER),  # within / past the prefilter
    SamplingConfig(0.8, top_p=0.9), SamplingConfig(3.0, top_p=0.95),  # a nucleus of a few / of many tokens
    SamplingConfig(1.2, top_k=2 * PREFILTER, top_p=0.97), SamplingConfig(0.7, top_k=10, top_p=0.5),
])
def test_prefiltered_filters_equal_a_full_sort(cfg):
    """Top-k / top-p read the PREFILTER largest logits only, and sort in full when a row's answer lies
    beyond them: on 4096-token rows, peaked and flat, the law equals the NumPy full-sort restatement
    (and the flat rows really do need more than PREFILTER tokens at T=3, top-p 0.95)."""
    rng = np.random.default_rng(0)
    logits = np.stack([rng.normal(0, 4, 4096), rng.normal(0, 0.3, 4096)]).astype(np.float32)  # peaked, flat
    got = np.asarray(jax.nn.softmax(filter_logits(jnp.asarray(logits), sampler(jax.random.PRNGKey(0), cfg))))
    want = filtered_probs(logits, cfg)
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_array_equal(got > 0, want > 0)
    if cfg.top_p == 0.95:
        assert (want[1] > 0).sum() > PREFILTER


@pytest.mark.parametrize("mode", ["ar", "bastion"])
def test_new_sampling_values_compile_nothing(converted, mode):
    """Temperature (0: greedy), top-k and top-p are traced: after the first request, requests with
    other values, greedy or sampled in any order, compile nothing at the same shapes, and greedy
    answers stay the same (seen to fail with greedy a static switch: 2 compilations at the first
    sampled request)."""
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.testing import tiny_drafter_config

    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=4), seed=2) if mode == "bastion" else None
    engine = Engine(target, stop_ids=[-1], drafter=drafter, buckets=(1, 4), top_k=2)
    first = engine.generate([[5, 9, 11]], max_new_tokens=6, mode=mode)
    n = engine.compilations
    for cfg in (SamplingConfig(0.7), SamplingConfig(1.3, top_k=5), SamplingConfig(), SamplingConfig(0.9, top_p=0.8),
                SamplingConfig(2.0, 7, 0.5), SamplingConfig()):
        res = engine.generate([[5, 9, 11]], max_new_tokens=6, mode=mode, sampling=cfg)
        assert res.stats.compilations == 0 and res.stats.compilations_after_warmup == 0, cfg
        if cfg.greedy:
            assert res.tokens == first.tokens
    assert engine.compilations == n
