"""Context lookup: the chain found on device vs a Python scan, history writes, and draft trees with a
chain vs brute-force enumeration of the two-state path scores."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.lookup import (
    Chain, LookupConfig, chain_curve, chain_outcome, find_chain, probabilities,
)
from bastion_jax.modeling.cache import append_rows
from bastion_jax.tree import ancestor_mask, build_tree, chain_tree, surrogate_curve
from tests.test_tree import assert_tree_is, node_paths, random_lattice

CFG = LookupConfig(max_ngram=3, first=(0.2, 0.5, 0.7), cont=(0.6, 0.7, 0.8))


def chain_by_scan(cfg: LookupConfig, text: list[int], depth: int) -> tuple[list[int], int]:
    """(chain tokens padded with -1, match length n): the longest suffix of n <= max_ngram tokens
    with an earlier occurrence, its latest one, the tokens after it, continued past the end of `text`
    as if text[end + 1:] repeated forever."""
    r = len(text) - 1
    for n in range(min(cfg.max_ngram, r + 1), 0, -1):
        suffix = text[r - n + 1:]
        for end in range(r - 1, n - 2, -1):
            if text[end - n + 1:end + 1] == suffix:
                loop = text[end + 1:]
                return [loop[j % len(loop)] for j in range(depth)], n
    return [-1] * depth, 0


@pytest.mark.parametrize("seed", range(30))
def test_chain_equals_python_scan(seed):
    rng = np.random.default_rng(seed)
    slots, depth = 24, 5
    vocab = int(rng.integers(2, 6))  # small vocabularies: matches of every length occur
    history = rng.integers(0, vocab, slots).astype(np.int32)
    root_pos = int(rng.integers(0, slots))
    got = jax.jit(find_chain, static_argnums=(0, 3))(CFG, jnp.asarray(history), jnp.int32(root_pos), depth)
    want, n = chain_by_scan(CFG, history[:root_pos + 1].tolist(), depth)
    assert np.asarray(got.tokens).tolist() == want
    assert float(got.first) == pytest.approx(CFG.first[n - 1] if n else 0.0)
    assert float(got.cont) == pytest.approx(CFG.cont[n - 1] if n else 0.0)


def test_chain_ignores_slots_past_the_root():
    """Tokens after the root (padding, rejected drafts) are never matched or copied: past the root the
    chain repeats what followed the match."""
    history = jnp.asarray([5, 1, 2, 9, 1, 2, 7, 7, 7], jnp.int32)
    got = find_chain(CFG, history, jnp.int32(5), 4)  # text 5 1 2 9 1 2: "1 2" matched at 1..2
    assert np.asarray(got.tokens).tolist() == [9, 1, 2, 9]
    assert float(got.first) == pytest.approx(0.5)


def test_append_rows_writes_count_tokens_and_drops_the_rest():
    history = jnp.zeros((2, 6), jnp.int32)
    out = append_rows(history, jnp.asarray([[1, 2, 3], [4, 5, 6]]), jnp.asarray([1, 4]), jnp.asarray([2, 3]))
    assert np.asarray(out).tolist() == [[0, 1, 2, 0, 0, 0], [0, 0, 0, 0, 4, 5]]  # row 1: slot 6 is past the end


def two_state_brute_force(lp: np.ndarray, m: int, top_k: int, chain: list[int], first: float, cont: float):
    """Every path of the candidates (each depth's top-k plus the chain's token), scored on the chain
    as log(w + (1 - w) p) for the chain's token (p the drafter's, whatever its rank) and log((1 - w) p)
    for others, off it as log p (the top-k only)."""
    depth, vocab = lp.shape
    p = np.exp(lp)
    cands = []
    for d in range(depth):
        c = list(np.argsort(-lp[d])[:top_k])
        if chain[d] >= 0 and chain[d] not in c:
            c.append(chain[d])
        cands.append(c)
    top = [set(np.argsort(-lp[d])[:top_k].tolist()) for d in range(depth)]
    paths = []
    for n in range(1, depth + 1):
        for toks in itertools.product(*cands[:n]):
            score, on = 0.0, True
            for d, t in enumerate(toks):
                w = (first if d == 0 else cont) if chain[d] >= 0 else 0.0
                if on and w > 0:
                    q = (1 - w) * (p[d, t] if t in top[d] or t == chain[d] else 0.0) + (w if t == chain[d] else 0.0)
                    score += np.log(q) if q > 0 else -np.inf
                else:
                    score += lp[d, t] if t in top[d] else -np.inf
                on = on and t == chain[d]
            if np.isfinite(score):
                paths.append((score, toks))
    paths.sort(key=lambda x: (-x[0], len(x[1])))
    return paths[:m]


@pytest.mark.parametrize("seed", range(30))
def test_tree_with_chain_equals_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    depth, vocab = int(rng.integers(2, 5)), int(rng.integers(3, 6))
    top_k = int(rng.integers(2, vocab))
    lp = random_lattice(rng, depth, vocab)
    chain = rng.integers(0, vocab, depth).tolist()
    cut = int(rng.integers(1, depth + 1))  # the chain may end before the block does
    chain = chain[:cut] + [-1] * (depth - cut)
    first, cont = float(rng.uniform(0.1, 0.9)), float(rng.uniform(0.1, 0.9))
    ref = two_state_brute_force(lp, 80, top_k, chain, first, cont)
    n = int(rng.integers(2, len(ref) + 3))
    c = Chain(jnp.asarray(chain, jnp.int32), jnp.float32(first), jnp.float32(cont))
    tree = jax.jit(build_tree, static_argnums=(2, 3))(jnp.int32(7), jnp.asarray(lp), n, top_k, None, c)
    assert_tree_is(tree, ref[: n - 1])


def test_no_chain_gives_the_drafters_tree():
    """A row without a match (tokens -1, weights 0) gets exactly the tree it gets with lookup off."""
    rng = np.random.default_rng(3)
    lp = jnp.asarray(random_lattice(rng, 4, 9))
    none = Chain(jnp.full((4,), -1, jnp.int32), jnp.float32(0.0), jnp.float32(0.0))
    a, b = build_tree(jnp.int32(1), lp, 20, 3), build_tree(jnp.int32(1), lp, 20, 3, None, none)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_draft_vocabulary_ids_map_candidates():
    """With `ids`, candidates are token ids (the chain is compared in id space)."""
    rng = np.random.default_rng(4)
    lp = jnp.asarray(random_lattice(rng, 3, 5))
    ids = jnp.asarray([10, 20, 30, 40, 50], jnp.int32)
    plain = build_tree(jnp.int32(1), lp, 12, 3)
    mapped = build_tree(jnp.int32(1), lp, 12, 3, ids)
    want = np.where(np.arange(12) > 0, np.asarray(ids)[np.maximum(np.asarray(plain.tokens), 0)], 1)
    want = np.where(np.asarray(plain.tokens) < 0, -1, want)
    np.testing.assert_array_equal(np.asarray(mapped.tokens), want)


def test_a_path_that_left_the_chain_gets_no_chain_probability():
    """After a token other than the chain's, the chain's later tokens are the drafter's own (here
    outside its top-k, so never proposed): the chain state follows the path, not the depth."""
    lp = np.log(np.asarray([[0.05, 0.9, 0.05, 1e-6], [0.9, 0.05, 0.05, 1e-6], [0.5, 0.5 - 2e-6, 1e-6, 1e-6]]))
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    chain = Chain(jnp.asarray([2, 0, 3], jnp.int32), jnp.float32(0.5), jnp.float32(0.9))  # c1 = 2, not the top
    tree = build_tree(jnp.int32(9), jnp.asarray(lp, jnp.float32), 12, 2, None, chain)
    paths = node_paths(tree)
    assert (2, 0, 3) in paths  # on the chain: token 3 (outside the top 2) is proposed with w + (1 - w) p, w = 0.9
    assert (1, 0, 3) not in paths  # left the chain at depth 1: token 3 is not a candidate there
    assert two_state_brute_force(lp, 11, 2, [2, 0, 3], 0.5, 0.9) == [
        (pytest.approx(float(s), abs=1e-5), p) for s, p in zip(np.asarray(tree.log_probs)[1:], paths)]


@pytest.mark.parametrize("mode", ["fixed:4", "fixed:8"])
def test_engine_lookup_raises_acceptance_and_keeps_greedy_output(converted, mode):
    """A random drafter accepts almost nothing; on a target that repeats itself (this tiny one loops)
    the lookup's chains are accepted, and the output still equals AR's token for token."""
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.testing import DraftingPays, tiny_drafter_config

    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=6), seed=2)
    prompts = [[5, 9, 11, 40, 41, 5, 9, 11], [7, 3, 20]]
    taus = {}
    for lookup in (None, LookupConfig()):
        engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4, 8), top_k=4, lookup=lookup,
                        latency=DraftingPays())
        ar = engine.generate(prompts, max_new_tokens=48, mode="ar").tokens
        res = engine.generate(prompts, max_new_tokens=48, mode=mode)
        assert res.tokens == ar
        taus[lookup is not None] = res.stats.tau
    assert taus[True] > taus[False] + 0.3, taus


def test_chain_curve_is_the_chains_path_probability_sum():
    chain = Chain(jnp.asarray([4, 5, 6, -1, -1], jnp.int32), jnp.float32(0.5), jnp.float32(0.8))
    curve = np.asarray(chain_curve(chain, (1, 2, 3, 8)))
    np.testing.assert_allclose(curve, [0.0, 0.5, 0.5 + 0.4, 0.5 + 0.4 + 0.32], rtol=1e-6)
    none = Chain(jnp.full((5,), -1, jnp.int32), jnp.float32(0.0), jnp.float32(0.0))
    assert np.asarray(chain_curve(none, (1, 4))).tolist() == [0.0, 0.0]


def test_a_root_step_that_does_not_draft_reports_the_lookup_chains_curve(converted):
    """After a root step that does not draft, the curve the step returns is the lookup chain's own
    (the draft gate's hint), computed from the token history the step extended with its own token;
    without lookup it is zero. Forty such steps on a tiny target that falls into a loop."""
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.sampling import SamplingConfig, sampler
    from bastion_jax.testing import tiny_drafter_config
    from bastion_jax.tree_decoding import FLUSH, HOLD

    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=6), seed=2)
    key = sampler(jax.random.PRNGKey(0), SamplingConfig())
    lookup = LookupConfig()
    prompt = [5, 9, 11, 40, 41]
    for on in (False, True):
        ex = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4, 8), top_k=4,
                    lookup=lookup if on else None).executables
        prefill, _ = ex.tree(1, 16, 64, ())
        toks = jnp.asarray([prompt + [0] * (16 - len(prompt))], jnp.int32)
        state, _ = prefill(ex.target_params, ex.drafter_params, ex.new_cache(1, 64), ex.new_drafter_cache(1, 64),
                           toks, jnp.asarray([len(prompt)], jnp.int32), key)
        text = prompt + [int(state.tree.tokens[0, 0])]
        roots = ex.roots(1, 64)
        longest = 0.0
        for i in range(40):
            then = HOLD if i % 2 else FLUSH  # (flushes keep the feature buffer from filling up)
            state, out, curve = roots[then](ex.target_params, ex.drafter_params, state, jnp.ones((1,), bool), key)
            text.append(int(out.tokens[0, 0]))  # the new root
            assert np.asarray(state.lookup.history[0, :len(text)]).tolist() == text
            if not on:
                assert np.asarray(curve).tolist() == [[0.0, 0.0, 0.0]]
                continue
            chain, n = chain_by_scan(lookup, text, 5)
            assert np.asarray(state.lookup.chain[0]).tolist() == chain and int(state.lookup.order[0]) == n
            first, cont = (np.asarray(x) for x in probabilities(lookup, state.lookup.counts[0]))  # this text's
            p = [first[n - 1] * cont[n - 1] ** d if t >= 0 else 0.0 for d, t in enumerate(chain)]
            np.testing.assert_allclose(np.asarray(curve)[0], [0.0, sum(p[:3]), sum(p[:5])], rtol=1e-5, atol=1e-7)
            longest = max(longest, float(np.asarray(curve)[0, -1]))
        assert not on or longest > 1.0, text  # the loop gives long matches
        if on:  # the chains were judged against what was committed: the counts moved
            assert float(state.lookup.counts[0, :, 1].sum()) > 10


@pytest.mark.parametrize("chain, committed, count, want", [
    ([4, 5, 6, -1], [4, 5, 9, 1, 1], 5, [1, 1, 1, 2]),  # c1, c2 right, c3 wrong: 2 continuation trials, 1 hit
    ([4, 5, 6, -1], [4, 5, 6, 1, 1], 5, [1, 1, 2, 2]),  # the whole chain right (its end is no trial)
    ([4, 5, 6, 7], [4, 5, -1, -1, -1], 2, [1, 1, 1, 1]),  # only 2 tokens known: c3 cannot be judged
    ([4, 5, 6, 7], [3, 5, 6, 7, 1], 5, [0, 1, 0, 0]),  # c1 wrong: nothing after it is tried
    ([-1, -1, -1, -1], [4, 5, 6, 7, 1], 5, [0, 0, 0, 0]),  # no chain, no trial
    ([4, 5, 6, 7], [4], 1, [1, 1, 0, 0]),  # a root step judges c1 only
])
def test_chain_outcome_counts_trials_and_hits(chain, committed, count, want):
    got = chain_outcome(jnp.asarray(chain, jnp.int32), jnp.asarray(committed, jnp.int32), jnp.int32(count))
    assert np.asarray(got).tolist() == want


def test_probabilities_start_at_the_table_and_follow_the_text():
    cfg = LookupConfig(max_ngram=2, first=(0.2, 0.6), cont=(0.5, 0.8), prior_weight=8.0)
    counts = np.zeros((2, 4), np.float32)
    first, cont = probabilities(cfg, jnp.asarray(counts))
    np.testing.assert_allclose(first, [0.2, 0.6], rtol=1e-6)
    np.testing.assert_allclose(cont, [0.5, 0.8], rtol=1e-6)
    counts[1] = [0, 24, 0, 0]  # 24 chains of a 2-token match whose first token was wrong
    first, cont = probabilities(cfg, jnp.asarray(counts))
    assert float(first[1]) == pytest.approx(0.6 * 8 / 32) and float(first[0]) == pytest.approx(0.2)


@pytest.mark.parametrize("n_nodes", [4, 6, 12])
@pytest.mark.parametrize("known", [0, 2, 5])
def test_chain_tree_is_the_chain_as_one_path(n_nodes, known):
    """The tree a held step leaves: root, then c_1..c_D each under the previous (tokens -1 past the
    known chain, never accepted), padding under the root past the chain; the ancestor mask is the
    parent relation's closure, and its surrogate is the chain's curve for every bucket."""
    depth = 5
    tokens = [7, 3, 9, 3, 1][:known] + [-1] * (depth - known)
    chain = Chain(jnp.asarray(tokens, jnp.int32), jnp.float32(0.6 if known else 0.0), jnp.float32(0.7 if known else 0.0))
    tree = chain_tree(jnp.int32(42), chain, n_nodes)
    on = min(depth, n_nodes - 1)  # chain nodes that fit
    want_tokens = ([42] + tokens + [-1] * n_nodes)[:n_nodes]
    assert np.asarray(tree.tokens).tolist() == want_tokens
    assert np.asarray(tree.parents).tolist() == [-1] + list(range(on)) + [0] * (n_nodes - 1 - on)
    assert np.asarray(tree.depths).tolist() == list(range(on + 1)) + [0] * (n_nodes - 1 - on)
    np.testing.assert_array_equal(np.asarray(tree.ancestors), np.asarray(ancestor_mask(tree.parents, depth)))
    buckets = tuple(b for b in (1, 2, 4, 6, 12) if b <= n_nodes)
    np.testing.assert_allclose(np.asarray(surrogate_curve(tree, buckets)), np.asarray(chain_curve(chain, buckets)),
                               rtol=1e-6, atol=1e-7)
    lp = np.asarray(tree.log_probs)
    assert lp[0] == 0.0 and np.isneginf(lp[1 + known:]).all()


def test_engine_verifies_held_chains_and_keeps_greedy_output(converted):
    """A drafter that never pays (the gate holds) on a target that repeats itself: bastion verifies
    the lookup's chains with tree steps that do not draft, commits several tokens per step, and the
    output equals AR's token for token in a batch whose rows end differently (a stop token, the
    budget), nothing after a stop. (bfloat16: tests/test_bf16.py.)"""
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.testing import ChainsPay, tiny_drafter_config

    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=8), seed=2)
    prompts = [[5, 9, 11, 40, 41, 5, 9, 11], [7, 3, 20], [12, 60, 61]]
    free = Engine(target, stop_ids=[-1]).generate(prompts, max_new_tokens=40, mode="ar").tokens
    stop = free[1][20]  # row 1 stops at its 21st token (or earlier if the token came before)
    ar = Engine(target, stop_ids=[stop]).generate(prompts, max_new_tokens=40, mode="ar").tokens
    engine = Engine(target, drafter=drafter, stop_ids=[stop], buckets=(1, 4, 8), top_k=4, latency=ChainsPay())
    res = engine.generate(prompts, max_new_tokens=40, mode="bastion")
    assert res.tokens == ar and len(ar[1]) <= 21 and ar[1][-1] == stop and len(ar[0]) == 40
    s = res.stats
    # Held chains verified, and accepted. (A batch verifies a chain when it pays for every row that
    # may end the batch, `controller.last_rows`: 3 such steps here, 5+ under the rows' mean before.)
    assert s.chain_steps >= 2 and s.tau > 1.3, s
    assert s.compilations_after_warmup == 0


@pytest.mark.parametrize("seed", range(6))
def test_chain_in_a_reduced_draft_vocabulary_scores_as_in_the_full_one(seed):
    """With a draft vocabulary (the lattice's columns are `ids`), the chain's token mixes with the
    drafter's probability of its column, found by id (and with none when the token has no column):
    the same tree as the full-vocabulary lattice holding those columns and -inf elsewhere."""
    rng = np.random.default_rng(300 + seed)
    depth, vocab = 3, 9
    ids = np.sort(rng.choice(vocab, 6, replace=False)).astype(np.int32)
    ids = rng.permutation(ids)  # columns in ranking order, not id order
    lp_draft = random_lattice(rng, depth, len(ids))
    lp_full = np.full((depth, vocab), -np.inf, np.float32)
    lp_full[:, ids] = lp_draft
    chain = rng.integers(0, vocab, depth).astype(np.int32)  # tokens with and without a column
    c = Chain(jnp.asarray(chain), jnp.float32(0.6), jnp.float32(0.7))
    n, k = int(rng.integers(4, 12)), int(rng.integers(2, len(ids) + 1))
    a = build_tree(jnp.int32(1), jnp.asarray(lp_draft), n, k, jnp.asarray(ids), c)
    b = build_tree(jnp.int32(1), jnp.asarray(lp_full), n, k, None, c)
    va, vb = np.asarray(a.tokens)[1:] >= 0, np.asarray(b.tokens)[1:] >= 0
    fa = np.isfinite(np.asarray(a.log_probs)[1:]) & va
    fb = np.isfinite(np.asarray(b.log_probs)[1:]) & vb
    assert fa.sum() == fb.sum()
    assert [p for p, f in zip(node_paths(a), fa) if f] == [p for p, f in zip(node_paths(b), fb) if f]
    np.testing.assert_allclose(np.asarray(a.log_probs)[1:][fa], np.asarray(b.log_probs)[1:][fb], rtol=1e-5, atol=1e-5)


def test_a_chain_with_no_weight_leaves_the_drafters_tree():
    """w = 0 (a LookupConfig table may hold zeros): the chain adds nothing, not even its token outside
    the top-k with the drafter's own probability."""
    lp = np.log(np.asarray([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]], np.float32))
    chain = Chain(jnp.asarray([3, 3], jnp.int32), jnp.float32(0.0), jnp.float32(0.0))  # token 3: outside the top 2
    with_chain = build_tree(jnp.int32(0), jnp.asarray(lp), 7, 2, None, chain)
    alone = build_tree(jnp.int32(0), jnp.asarray(lp), 7, 2)
    assert node_paths(with_chain) == node_paths(alone)
    np.testing.assert_allclose(np.asarray(with_chain.log_probs), np.asarray(alone.log_probs))
