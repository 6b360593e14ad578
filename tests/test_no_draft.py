"""Steps that do not draft (issue 12): AR steps mixed with tree steps keep greedy identity, keep the
drafter's context exactly what drafting every step would give, and keep T > 0 sampling exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bastion_jax.checkpoint import random_drafter
from bastion_jax.engine import Engine
from bastion_jax.modeling.cache import KVCache, causal_mask
from bastion_jax.sampling import SamplingConfig
from bastion_jax.testing import tiny_drafter_config
from bastion_jax.tree_decoding import pending_slots, root_step, tree_prefill, tree_step

BLOCK = 5
BUCKETS = (1, 4, 8)
HOLD, DRAFT, FLUSH = 0, 1, 2


def drive(target, drafter, prompts, n_steps, seed, sampling=SamplingConfig(), cache_len=128, schedule=None):
    """Run prefill + `n_steps` steps with a random schedule of step kinds (tree step with any bucket
    and hold/draft, root step with hold/draft/flush), as the host would. Returns (tokens per row,
    final state, kinds used)."""
    rng = np.random.default_rng(seed)
    b = len(prompts)
    static = dict(target_def=target.graphdef, drafter_def=drafter.graphdef, sampling=sampling, block_size=BLOCK,
                  mask_token_id=drafter.config.mask_token_id, tap_layers=tuple(drafter.config.target_layer_ids),
                  proposal=None, buckets=BUCKETS, top_k=4)
    lens = np.array([len(p) for p in prompts], np.int32)
    padded = np.zeros((b, 16), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    tcache = KVCache.create(target.config, b, cache_len, target.dtype)
    dcache = KVCache.create(drafter.config, b, cache_len, target.dtype)
    key = jax.random.PRNGKey(seed)
    state, _ = tree_prefill(target.state, drafter.state, tcache, dcache, jnp.asarray(padded), jnp.asarray(lens),
                            key, **static)
    out = [[int(t)] for t in np.asarray(state.tree.tokens[:, 0])]
    active = jnp.ones((b,), bool)
    held, pending, kinds = False, 0, []
    w = pending_slots(BLOCK)
    for step in range(n_steps):
        key, sub = jax.random.split(key)
        if schedule is not None:
            then = schedule[step]
        elif held and pending + 2 > w:
            then = int(rng.choice([DRAFT, FLUSH]))
        else:
            then = int(rng.choice([HOLD, DRAFT, FLUSH] if held else [HOLD, DRAFT]))
        if held:
            state, res, _ = root_step(target.state, drafter.state, state, active, sub, then, **static)
            kinds.append(("root", then))
        else:
            bucket = int(rng.choice(BUCKETS))
            state, res, _ = tree_step(target.state, drafter.state, state, active, sub, then, bucket=bucket, **static)
            kinds.append((bucket, then))
        toks, counts = np.asarray(res.tokens), np.asarray(res.count)
        for i in range(b):
            out[i].extend(toks[i, :counts[i]].tolist())
        pending = 0 if then != HOLD else pending + int(counts.max())
        held = then != DRAFT
    return out, state, kinds


@pytest.fixture(scope="module")
def pair(converted):
    _, target = converted("qwen3")
    return target, random_drafter(tiny_drafter_config(target.config, block_size=BLOCK), seed=2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_steps_greedy_equal_ar(pair, seed):
    target, drafter = pair
    prompts = [[5, 9, 11, 40, 41], [7, 3, 20]]
    got, _, kinds = drive(target, drafter, prompts, 40, seed)
    assert {k for _, k in kinds} == {HOLD, DRAFT, FLUSH} or seed != 0
    assert any(k[0] == "root" for k in kinds) and any(k[0] != "root" for k in kinds)
    n = min(map(len, got))
    ar = Engine(target, stop_ids=[-1]).generate(prompts, max_new_tokens=n, mode="ar").tokens
    assert [g[:n] for g in got] == ar


def test_drafter_context_equals_injecting_every_committed_token(pair):
    """After a schedule of held, flushed and drafted steps, the drafter cache holds, for every
    position it has been given, exactly the K/V of injecting the whole committed sequence at once."""
    target, drafter = pair
    prompt = [5, 9, 11, 40, 41]
    schedule = [HOLD, HOLD, HOLD, FLUSH, HOLD, DRAFT, HOLD, DRAFT, DRAFT, HOLD, HOLD, HOLD, HOLD, DRAFT, HOLD]
    got, state, _ = drive(target, drafter, [prompt], len(schedule), 0, schedule=schedule)
    length, pend = int(state.length[0]), int(state.pending_len[0])
    assert pend > 0  # the last step held: some features are still buffered
    seq = (prompt + got[0])[:length]
    model = nnx.merge(target.graphdef, target.state)
    zero = jnp.zeros(1, jnp.int32)
    cache = KVCache.create(target.config, 1, 128, target.dtype)
    taps = tuple(drafter.config.target_layer_ids)
    feats = model(jnp.asarray([seq]), jnp.arange(length)[None], cache, zero, causal_mask(zero, length, 128),
                  tap_layers=taps).taps  # [1, length, F]
    d = nnx.merge(drafter.graphdef, drafter.state)
    ref = d.inject(feats, zero, KVCache.create(drafter.config, 1, 128, target.dtype), target.dtype)
    ctx = length - pend
    for got_kv, want_kv in zip(state.drafter_cache.k + state.drafter_cache.v, ref.k + ref.v):
        np.testing.assert_allclose(np.asarray(got_kv)[0, :ctx], np.asarray(want_kv)[0, :ctx], atol=1e-5)
    np.testing.assert_allclose(np.asarray(state.pending)[0, :pend], np.asarray(feats)[0, ctx:length], atol=1e-5)


def test_mixed_steps_sample_the_target_law(vocab6_target):
    """T = 1: the three tokens after the prompt (prefill, a tree step that holds, a root step)
    follow the target's exact joint law."""
    from bastion_jax.testing import next_token_probs

    target, prompt = vocab6_target, [1, 4, 3]
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK, num_taps=1), seed=1)
    v = target.config.vocab_size
    p1 = next_token_probs(target, prompt)
    law = np.zeros((v, v, v))
    for a in range(v):
        p2 = next_token_probs(target, prompt + [a])
        for c in range(v):
            law[a, c] = p1[a] * p2[c] * next_token_probs(target, prompt + [a, c])
    rows = 4000
    got, _, _ = drive(target, drafter, [prompt] * rows, 2, 3, sampling=SamplingConfig(1.0), schedule=[HOLD, HOLD])
    triples = np.array([g[:3] for g in got])
    counts = np.zeros_like(law)
    np.add.at(counts, tuple(triples.T), 1)
    expected = law * rows
    m = expected > 5
    chi2 = float(((counts[m] - expected[m]) ** 2 / expected[m]).sum())
    assert chi2 < 1.5 * m.sum() + 60  # dof ~ m.sum(): far beyond p = 1e-4 only for a biased sampler


def test_draft_vocab_permutation_gives_the_same_trees(pair):
    """A draft vocabulary holding every token (in a shuffled order) must reproduce the full-vocabulary
    trees exactly: the index -> token map is applied to every node and never to the root."""
    from bastion_jax.speculative import DraftVocab

    target, drafter = pair
    static = dict(target_def=target.graphdef, drafter_def=drafter.graphdef, sampling=SamplingConfig(),
                  block_size=BLOCK, mask_token_id=drafter.config.mask_token_id,
                  tap_layers=tuple(drafter.config.target_layer_ids), proposal=None, buckets=BUCKETS, top_k=4)
    v = target.config.vocab_size
    padded = jnp.asarray([[5, 9, 11, 40, 41] + [0] * 11])
    args = lambda: (target.state, drafter.state, KVCache.create(target.config, 1, 64, target.dtype),  # noqa: E731
                    KVCache.create(drafter.config, 1, 64, target.dtype), padded, jnp.array([5]), jax.random.PRNGKey(0))
    full, curve = tree_prefill(*args(), **static)
    shuffled = DraftVocab.from_ranking(target, np.random.default_rng(0).permutation(v), v)
    same, curve2 = tree_prefill(*args(), shuffled, **static)
    np.testing.assert_array_equal(np.asarray(same.tree.tokens), np.asarray(full.tree.tokens))
    np.testing.assert_allclose(np.asarray(curve2), np.asarray(curve), rtol=1e-5)
    small = DraftVocab.from_ranking(target, np.arange(v)[::-1], 20)  # ids 95..76 only
    part, _ = tree_prefill(*args(), small, **static)
    toks = np.asarray(part.tree.tokens)[0]
    assert toks[0] == int(full.tree.tokens[0, 0])  # the root is the target's token, not remapped
    assert set(toks[1:][toks[1:] >= 0]) <= set(range(76, 96))
    with pytest.raises(ValueError, match="distinct ids"):
        DraftVocab.from_ranking(target, [3, 3, 4], 3)
