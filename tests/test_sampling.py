"""Sampling rules: the empirical distribution of `sample` equals the filtered softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.sampling import SamplingConfig, filter_logits, sample

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
    draws = np.asarray(jax.vmap(lambda k: sample(LOGITS, k, cfg))(keys))
    counts = np.bincount(draws, minlength=5)
    exp = expected_probs(cfg) * n
    assert (counts[exp == 0] == 0).all(), "a filtered-out token was sampled"
    m = exp > 0
    chi2 = (((counts[m] - exp[m]) ** 2) / exp[m]).sum()
    assert chi2 < 20.0, (counts, exp)  # df <= 4: p < 1e-3 for a correct sampler


def test_filter_keeps_probabilities_of_kept_tokens():
    out = np.asarray(jax.nn.softmax(filter_logits(LOGITS, SamplingConfig(1.0, top_k=2))))
    np.testing.assert_allclose(out, [0, 0.4 / 0.65, 0.25 / 0.65, 0, 0], atol=1e-6)


def test_greedy_is_argmax():
    assert int(sample(LOGITS, jax.random.PRNGKey(0), SamplingConfig())) == 1


def test_invalid_sampling_config():
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(-1.0)
