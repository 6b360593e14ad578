"""Steps that do not draft (issue 12): AR steps mixed with tree steps keep greedy identity, keep the
drafter's context exactly what drafting every step would give, and keep T > 0 sampling exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bastion_jax.checkpoints import random_drafter
from bastion_jax.engine import Engine, GenerationError
from bastion_jax.modeling.cache import KVCache, causal_mask
from bastion_jax.sampling import SamplingConfig, sampler
from bastion_jax.step_config import StepConfig
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
    cfg = StepConfig.of(target, drafter, buckets=BUCKETS, top_k=4)
    lens = np.array([len(p) for p in prompts], np.int32)
    padded = np.zeros((b, 16), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    tcache = KVCache.create(target.config, b, cache_len, target.dtype)
    dcache = KVCache.create(drafter.config, b, cache_len, target.dtype)
    key = jax.random.PRNGKey(seed)
    params = sampler(key, sampling)  # temperature / top-k / top-p as arrays; the key changes per step
    state, _ = tree_prefill(cfg, target.state, drafter.state, tcache, dcache, jnp.asarray(padded),
                            jnp.asarray(lens), params)
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
        # With a tree in hand the host may still take a root step (dropping the tree), as the engine
        # does when drafting stops paying.
        if held or (schedule is None and rng.random() < 0.3):
            state, res, _ = root_step(cfg, target.state, drafter.state, state, active, params.replace(key=sub),
                                      then=then)
            kinds.append(("root", then))
        else:
            bucket = int(rng.choice(BUCKETS))
            state, res, _ = tree_step(cfg, target.state, drafter.state, state, active, params.replace(key=sub),
                                      bucket=bucket, then=then)
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
    feats = model(jnp.asarray([seq]), jnp.arange(length)[None], cache, zero, causal_mask(zero.shape[0], length),
                  tap_layers=taps).taps  # [1, length, F]
    d = nnx.merge(drafter.graphdef, drafter.state)
    ref = d.inject(feats, zero, jnp.asarray([length], jnp.int32), KVCache.create(drafter.config, 1, 128, target.dtype),
                   target.dtype)
    ctx = length - pend
    for got_kv, want_kv in ((state.drafter_cache.k, ref.k), (state.drafter_cache.v, ref.v)):  # [layers, b, kv, slots, d]
        np.testing.assert_allclose(np.asarray(got_kv)[:, 0, :, :ctx], np.asarray(want_kv)[:, 0, :, :ctx], atol=1e-5)
    np.testing.assert_allclose(np.asarray(state.pending)[0, :pend], np.asarray(feats)[0, ctx:length], atol=1e-5)


def test_mixed_steps_sample_the_target_law(peaked_target):
    """T = 1: the three tokens after the prompt (prefill, a tree step that holds, a root step)
    follow the target's exact joint law."""
    target, prompt = peaked_target, [1, 4, 3]
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK, num_taps=1), seed=1)
    got, _, _ = drive(target, drafter, [prompt] * 2500, 2, 3, sampling=SamplingConfig(1.0), schedule=[HOLD, HOLD])
    assert_three_token_law(target, prompt, got)


def assert_three_token_law(target, prompt, got):
    """The first three tokens of each row in `got` follow the target's exact joint law at T = 1:
    Pearson chi-square below its p = 1e-4 limit, and no row with a token of probability zero. On the
    peaked 6-token target, 2,500 rows drawn at 1.5 times the temperature failed both callers (chi2
    1150 against a limit of 111)."""
    from scipy import stats

    from bastion_jax.testing import law_chi_square, token_law

    assert len(got) == 2500 and all(len(g) >= 3 for g in got)
    chi2, dof, impossible = law_chi_square(got, token_law(target, prompt, 3, SamplingConfig(1.0)))
    assert impossible == 0 and chi2 < stats.chi2.isf(1e-4, dof), (chi2, dof, impossible)


def test_engine_root_steps_dispatched_ahead_sample_the_target_law(peaked_target):
    """T = 1 through `Engine.stream`: a gate that knows drafting does not pay takes held root steps,
    the second dispatched before the first is read (lookahead), each with its own key."""
    target, prompt = peaked_target, [1, 4, 3]
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK, num_taps=1), seed=1)
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=BUCKETS, top_k=4, latency=FixedLatency(BUCKETS))
    # learnt, for batches of 2,500 rows: the drafts are never accepted (rho = 0 / 1, after 100 verified trees)
    engine._gate_memory.setdefault((2500, False), {}).update(calibration=(0.0, 1.0, 100), a_bar=np.ones(len(BUCKETS)))
    res = engine.generate([prompt] * 2500, max_new_tokens=3, mode="bastion", sampling=SamplingConfig(1.0), seed=5)
    assert res.stats.buckets == {0: 2}  # two root steps after the prefill
    assert_three_token_law(target, prompt, res.tokens)


def test_draft_vocab_permutation_gives_the_same_trees(pair):
    """A draft vocabulary holding every token (in a shuffled order) must reproduce the full-vocabulary
    trees exactly: the index -> token map is applied to every node and never to the root."""
    from bastion_jax.speculative import DraftVocab

    target, drafter = pair
    cfg = StepConfig.of(target, drafter, buckets=BUCKETS, top_k=4)
    v = target.config.vocab_size
    padded = jnp.asarray([[5, 9, 11, 40, 41] + [0] * 11])
    args = lambda: (cfg, target.state, drafter.state, KVCache.create(target.config, 1, 64, target.dtype),  # noqa: E731
                    KVCache.create(drafter.config, 1, 64, target.dtype), padded, jnp.array([5]),
                    sampler(jax.random.PRNGKey(0), SamplingConfig()))
    full, curve = tree_prefill(*args())
    shuffled = DraftVocab.from_ranking(target, np.random.default_rng(0).permutation(v), v)
    same, curve2 = tree_prefill(*args(), shuffled)
    np.testing.assert_array_equal(np.asarray(same.tree.tokens), np.asarray(full.tree.tokens))
    np.testing.assert_allclose(np.asarray(curve2), np.asarray(curve), rtol=1e-5)
    small = DraftVocab.from_ranking(target, np.arange(v)[::-1], 20)  # ids 95..76 only
    part, _ = tree_prefill(*args(), small)
    toks = np.asarray(part.tree.tokens)[0]
    assert toks[0] == int(full.tree.tokens[0, 0])  # the root is the target's token, not remapped
    assert set(toks[1:][toks[1:] >= 0]) <= set(range(76, 96))
    with pytest.raises(ValueError, match="distinct ids"):
        DraftVocab.from_ranking(target, [3, 3, 4], 3)


class FixedLatency:
    """A latency model with set step times and no online correction: AR 1.0, a root step that drafts
    1.6, a tree step of b nodes 1.6 + 0.01 b (drafting costs 0.6 of an AR step, as on a small CPU)."""

    def __init__(self, buckets):
        self.buckets = buckets

    def predict(self, b, c):
        return {"ar": 1.0, "ar+draft": 1.6}.get(b) or 1.6 + 0.01 * b

    def step_time(self, b, c, draft):
        if b == 0:
            return 1.6 if draft else 1.0
        return self.predict(b, c) - (0.0 if draft else 0.6)

    def observe(self, *a):
        pass


@pytest.mark.parametrize("kind", ["oracle", "useless"])
def test_gate_drafts_for_an_oracle_and_stops_for_a_useless_drafter(converted, kind):
    from bastion_jax.testing import greedy_continuation

    _, target = converted("qwen3")
    prompt, n = [5, 9, 11, 40, 41], 120
    table = jnp.asarray(greedy_continuation(target, prompt, n + BLOCK + 1))
    vocab = target.config.vocab_size

    def propose(root, start, logits):
        k = jnp.arange(1, logits.shape[1] + 1)
        right = table[jnp.clip(start[:, None] + k[None], 0, table.shape[0] - 1)]  # [b, B-1]
        token = right if kind == "oracle" else (right + 1) % vocab  # useless: confidently wrong
        return jnp.full(logits.shape, -10.0) + 20.0 * jax.nn.one_hot(token, vocab)

    # The context lookup off: its chains (this target repeats itself) would make the useless drafter's
    # trees worth verifying now and then; the gate is what this test is about.
    engine = Engine(target, stop_ids=[-1], block_size=BLOCK, buckets=BUCKETS, top_k=2, proposal=propose,
                    latency=FixedLatency(BUCKETS), lookup=None)
    res = engine.generate([prompt], max_new_tokens=n, mode="bastion")
    assert res.tokens[0] == np.asarray(table[len(prompt):len(prompt) + n]).tolist()
    ar_steps = res.stats.buckets.get(0, 0)
    if kind == "oracle":
        assert ar_steps == 0 and res.stats.tau > 3.5
    else:
        # A few drafting steps teach the gate that the surrogate is never realised (~8: rho's prior
        # counts as 8 verified trees); from then on it takes AR steps, with sparse probes (intervals
        # doubling up to 64: 4 or 5 in 120 tokens).
        assert ar_steps >= 0.85 * res.stats.steps
        assert res.stats.steps - ar_steps <= 14


def test_resolve_draft_vocab(pair, tmp_path, monkeypatch):
    from bastion_jax import speculative
    from bastion_jax.checkpoints import load_drafter
    from bastion_jax.speculative import RANKING_FILE, resolve_draft_vocab
    from bastion_jax.checkpoints.dflash import export_zlab

    target, drafter = pair
    export_zlab(drafter.config, drafter.state, tmp_path / "d", jnp.float32)
    loaded = load_drafter(tmp_path / "d", target.config)
    assert resolve_draft_vocab(target, loaded, "auto") is None  # no ranking shipped: full vocabulary
    with pytest.raises(ValueError, match="needs a token ranking"):
        resolve_draft_vocab(target, loaded, "20")
    ranking = np.arange(target.config.vocab_size, dtype=np.int32)[::-1]
    np.save(tmp_path / "d" / RANKING_FILE, ranking)
    dv = resolve_draft_vocab(target, loaded, "20")
    assert np.asarray(dv.ids).tolist() == ranking[:20].tolist()
    assert resolve_draft_vocab(target, loaded, "full") is None
    assert resolve_draft_vocab(target, loaded, "auto") is None  # a 96-token vocabulary is below the default 8192
    with pytest.raises(ValueError, match="auto, full or a token count"):
        resolve_draft_vocab(target, loaded, "lots")
    # The engine takes the CLI's specs, and by default does what the CLI does ("auto": the ranking's top
    # DEFAULT_DRAFT_VOCAB, here lowered below the tiny vocabulary so that auto picks a subset).
    assert np.asarray(Engine(target, drafter=loaded, stop_ids=[-1], draft_vocab="20").draft_vocab.ids).tolist() == \
        ranking[:20].tolist()
    assert Engine(target, drafter=loaded, stop_ids=[-1], draft_vocab="full").draft_vocab is None
    assert np.asarray(Engine(target, drafter=loaded, stop_ids=[-1], draft_vocab=np.int64(20)).draft_vocab.ids).tolist() \
        == ranking[:20].tolist()  # a NumPy integer is a token count too
    monkeypatch.setattr(speculative, "DEFAULT_DRAFT_VOCAB", 32)
    assert np.asarray(Engine(target, drafter=loaded, stop_ids=[-1]).draft_vocab.ids).tolist() == ranking[:32].tolist()
    assert Engine(target, stop_ids=[-1]).draft_vocab is None  # no drafter: nothing to restrict
    with pytest.raises(GenerationError, match="needs a drafter"):  # asked for, but no drafter: refused, not ignored
        Engine(target, stop_ids=[-1], draft_vocab="20")
    engine = Engine(target, drafter=loaded, stop_ids=[-1], buckets=BUCKETS, top_k=4, draft_vocab=dv)
    prompts = [[5, 9, 11, 40, 41]]
    ar = engine.generate(prompts, max_new_tokens=16, mode="ar").tokens
    for mode in ("bastion", "fixed:8", "dflash"):
        assert engine.generate(prompts, max_new_tokens=16, mode=mode).tokens == ar


def test_engine_root_steps_dispatched_ahead_keep_greedy_and_stops(pair):
    """Greedy, a batch whose rows stop at different steps (a stop token in one, the budget in the
    other) under held root steps dispatched ahead: token-identical to AR, nothing past a stop. (The
    lookup is off: with it, held chains would be verified instead, `test_lookup.py`.)"""
    target, drafter = pair
    prompts = [[5, 9, 11, 40, 41], [7, 3, 20]]
    free = Engine(target, stop_ids=[-1]).generate(prompts, max_new_tokens=30, mode="ar").tokens
    stop = free[0][6]  # row 0 stops at its 7th token (or earlier if the token came before)
    ar = Engine(target, stop_ids=[stop]).generate(prompts, max_new_tokens=30, mode="ar").tokens
    engine = Engine(target, drafter=drafter, stop_ids=[stop], buckets=BUCKETS, top_k=4,
                    latency=FixedLatency(BUCKETS), lookup=None)
    engine._gate_memory.setdefault((1, True), {}).update(calibration=(0.0, 1.0, 100), a_bar=np.ones(len(BUCKETS)))
    res = engine.generate(prompts, max_new_tokens=30, mode="bastion")
    assert res.tokens == ar and len(ar[0]) <= 7 < len(ar[1])
    assert res.stats.buckets[0] >= 0.8 * res.stats.steps  # root steps (with probes that draft)
    assert sum(res.stats.buckets.values()) == res.stats.steps  # every step counted once


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(0.9, top_k=20)], ids=["greedy", "T0.9"])
def test_engine_fixed_tree_steps_dispatched_ahead(pair, monkeypatch, sampling):
    """fixed:N dispatches each tree step before the previous one is read. A batch whose rows stop at
    different steps (a stop token, the budget): the same tokens as the loop that never looks ahead
    (same seed, so the same key per step), greedy equal to AR, nothing past a stop."""
    from bastion_jax.tree_loop import TreeLoop

    target, drafter = pair
    prompts = [[5, 9, 11, 40, 41], [7, 3, 20]]
    free = Engine(target, stop_ids=[-1]).generate(prompts, max_new_tokens=40, mode="ar", sampling=sampling,
                                                  seed=3).tokens
    stop = free[0][12]  # row 0 stops at its 13th token (or earlier)
    engine = Engine(target, drafter=drafter, stop_ids=[stop], buckets=BUCKETS, top_k=4)
    real_step, ahead = TreeLoop.step, []

    def spy(self, *a, **k):
        out = real_step(self, *a, **k)
        ahead.append(self.queued is not None)
        return out

    monkeypatch.setattr(TreeLoop, "step", spy)
    res = engine.generate(prompts, max_new_tokens=40, mode="fixed:4", sampling=sampling, seed=3)
    # It looked ahead, and nothing was left queued when the request ended on a budget; a step sent
    # ahead of a read that then ends the last row on a stop id is computed and dropped (sampled rows
    # may all end on the stop id).
    last_on_stop = all(row[-1] == stop and len(row) < 40 for row in res.tokens)
    assert sum(ahead) >= 3 and (not ahead[-1] or last_on_stop)
    monkeypatch.setattr(TreeLoop, "step", lambda self, *a, **k: real_step(self, *a[:6], tree_ahead=False))
    serial = engine.generate(prompts, max_new_tokens=40, mode="fixed:4", sampling=sampling, seed=3)
    assert res.tokens == serial.tokens
    for row in res.tokens:  # each row ends at its first stop or at the budget
        assert stop not in row[:-1] and (row[-1] == stop or len(row) == 40)
    if sampling.greedy:
        assert len(res.tokens[0]) <= 13 and len(res.tokens[1]) == 40 and res.tokens[0][-1] == stop
        assert res.tokens == Engine(target, stop_ids=[stop]).generate(prompts, max_new_tokens=40, mode="ar").tokens


def test_probe_interval_carries_over_to_the_next_request(pair, monkeypatch):
    """Probes that do not pay grow the interval between them, and the next request starts from that
    interval (as it does from rho and A_bar), so text like the last request's is not probed from 4
    again; a probe that pays (here: never) would reset it."""
    from bastion_jax.draft_gate import DraftGate
    from bastion_jax.tree_decoding import DRAFT

    target, drafter = pair
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=BUCKETS, top_k=4, latency=FixedLatency(BUCKETS),
                    lookup=None)
    # learnt: the drafts are never accepted (rho = 0 / 1, after 100 verified trees)
    engine._gate_memory.setdefault((1, True), {}).update(calibration=(0.0, 1.0, 100), a_bar=np.ones(len(BUCKETS)))
    probes, real = [], DraftGate.root_then
    monkeypatch.setattr(DraftGate, "root_then", lambda self, *a: (lambda t: (probes.append(t == DRAFT), t)[1])(
        real(self, *a)))
    counts = []
    for prompt in ([5, 9, 11, 40, 41], [7, 3, 20], [12, 60, 61]):
        probes.clear()
        engine.generate([prompt], max_new_tokens=40, mode="bastion")
        counts.append(sum(probes))
    assert engine._gate_memory[(1, True)]["probe"] == 64
    assert counts[0] >= 3 and counts[2] <= 1, counts  # 4, 8, 16, ... apart; then 64 apart from the start


def test_gate_memory_is_kept_per_batch_size_and_sampling_kind(pair):
    """What the gate learns of a batch is its last row's (`controller.batch_curve`), not one row's, so
    a batch's estimates never become a single prompt's, nor the other way round; and what it learns
    under argmax never becomes what it expects of samples (a tree accepts other lengths)."""
    target, drafter = pair
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=BUCKETS, top_k=4, latency=FixedLatency(BUCKETS),
                    lookup=None)
    engine._gate_memory.setdefault((1, True), {}).update(calibration=(0.0, 1.0, 100), a_bar=np.ones(len(BUCKETS)))
    single = dict(engine._gate_memory[(1, True)])
    engine.generate([[5, 9, 11, 40, 41], [7, 3, 20]], max_new_tokens=12, mode="bastion")
    engine.generate([[5, 9, 11, 40, 41]], max_new_tokens=12, mode="bastion", sampling=SamplingConfig(0.8), seed=1)
    assert set(engine._gate_memory) == {(1, True), (2, True), (1, False)}
    assert engine._gate_memory[(1, True)] == single  # untouched by the batch and by the sampled request
    assert engine._gate_memory[(1, False)]["calibration"] != single["calibration"]  # learnt from its own start
