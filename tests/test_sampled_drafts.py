"""benchmarks.sampled_drafts: its acceptance formulas against cases with known answers."""

import numpy as np

from benchmarks.sampled_drafts import rrs_accept, spec_accept, top_mass


def test_fixed_children_take_the_targets_mass_on_the_drafters_top_tokens():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.1, 0.2, 0.6, 0.1])  # q ranks token 2, then 1, then 0
    assert np.isclose(top_mass(p, q, 1), 0.2)
    assert np.isclose(top_mass(p, q, 2), 0.5)
    assert np.isclose(top_mass(p, q, 4), 1.0)


def test_speculative_sampling_accepts_one_minus_the_total_variation():
    p = np.array([0.5, 0.3, 0.2])
    assert np.isclose(spec_accept(p, p), 1.0)  # the drafter's law is the target's: always accepted
    q = np.array([0.2, 0.3, 0.5])
    assert np.isclose(spec_accept(p, q), 1 - 0.5 * np.abs(p - q).sum())


def test_recursive_rejection_matches_its_exact_values():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.2])
    assert rrs_accept(p, p, 1, rng, 400) == 1.0
    point = np.array([0.0, 1.0, 0.0])  # a deterministic draft: accepted with p of it, however many tries
    assert abs(rrs_accept(p, point, 1, rng, 4000) - 0.3) < 0.03
    assert abs(rrs_accept(p, point, 3, rng, 4000) - 0.3) < 0.03
    # Two draws without replacement from a uniform q over three tokens, p as above. Exactly: the first
    # draw is accepted with sum min(p, 1/3) = 5/6; a rejection (of token 1 or 2) leaves p' = [1, 0, 0],
    # and the second draw, uniform over the two tokens left, is token 0 half the time: 5/6 + 1/12.
    q = np.full(3, 1 / 3)
    assert abs(rrs_accept(p, q, 2, rng, 8000) - 11 / 12) < 0.015
