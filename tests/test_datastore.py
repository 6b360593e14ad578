"""Datastore lookup: the suffix order, the chain found on device vs a brute-force Python search and
vote, files (round trip, refusals), the choice between the context's and the datastore's chain, and
engine runs that copy from it with greedy output still AR's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.datastore import (
    FILE, MAX_MATCH, NUM_CLASSES, SAMPLES, SEP, Datastore, DatastoreError, build_order, chain_class, corpus,
    datastore_info, load_datastore, save_datastore, store_chain,
)
from bastion_jax.lookup import LookupConfig, LookupState, current_chain, primary


def small_store(seqs, first=None, cont=None) -> Datastore:
    tokens = corpus(seqs)
    z = jnp.zeros(NUM_CLASSES, jnp.float32)
    return Datastore(jnp.asarray(tokens), jnp.asarray(build_order(tokens)),
                     z if first is None else jnp.asarray(first, jnp.float32),
                     z if cont is None else jnp.asarray(cont, jnp.float32))


def brute_chain(tokens: np.ndarray, text: list[int], depth: int) -> tuple[list[int], int, int, float]:
    """(chain, n, occurrences, first vote's share) by scanning the corpus: the longest suffix of the
    text (n <= MAX_MATCH) that occurs, then per depth the most common next token among the
    occurrences that agreed so far (ties: the smallest id; a sequence's end votes for nothing)."""
    r = len(text) - 1
    best, occ = 0, []
    for n in range(1, min(MAX_MATCH, r + 1) + 1):
        found = [i for i in range(n, len(tokens) + 1) if tokens[i - n:i].tolist() == text[r - n + 1:]]
        if not found:
            break
        best, occ = n, found
    chain, share, alive = [], 0.0, occ
    for d in range(depth if best else 0):
        nxt = [int(tokens[i + d]) for i in alive if i + d < len(tokens) and tokens[i + d] != SEP]
        if not nxt:
            break
        vals, counts = np.unique(nxt, return_counts=True)
        win = int(vals[counts == counts.max()].min())
        if d == 0:
            share = counts.max() / len(alive)
        chain.append(win)
        alive = [i for i in alive if i + d < len(tokens) and tokens[i + d] == win]
    return chain + [-1] * (depth - len(chain)), best, len(occ), share


def test_order_sorts_positions_by_their_preceding_tokens_read_backwards():
    rng = np.random.default_rng(0)
    tokens = corpus([rng.integers(0, 4, rng.integers(1, 12)) for _ in range(30)])
    order = build_order(tokens)
    assert sorted(order.tolist()) == list(range(len(tokens)))
    key = lambda i: [int(tokens[i - j]) if i - j >= 0 else SEP for j in range(1, MAX_MATCH + 1)]  # noqa: E731
    keys = [key(i) for i in order]
    assert keys == sorted(keys)


@pytest.mark.parametrize("seed", range(12))
def test_chain_equals_brute_force_search_and_vote(seed):
    """Corpora small enough that every occurrence votes (at most SAMPLES of them): the device search
    and vote give exactly the brute-force chain, and the class of its match length and share."""
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(12, 30))
    seqs = [rng.integers(0, vocab, rng.integers(3, 30)) for _ in range(25)]
    store = small_store(seqs)
    tokens = np.asarray(store.tokens)
    depth = 6
    find = jax.jit(store_chain, static_argnums=3)
    checked = 0
    for _ in range(40):
        if rng.random() < 0.5:  # a text that continues a corpus sequence: long matches
            s = seqs[int(rng.integers(len(seqs)))]
            history = np.concatenate([rng.integers(0, vocab, 3), s[:int(rng.integers(1, len(s) + 1))]])
        else:
            history = rng.integers(0, vocab, int(rng.integers(1, 20)))
        want, n, occurrences, share = brute_chain(tokens, history.tolist(), depth)
        if occurrences > SAMPLES:
            continue
        padded = np.zeros(40, np.int32)
        padded[:len(history)] = history
        chain, cls, found = find(store, jnp.asarray(padded), jnp.int32(len(history) - 1), depth)
        assert np.asarray(chain).tolist() == want
        assert bool(found) == (want[0] >= 0)
        if want[0] >= 0:
            assert int(cls) == int(chain_class(jnp.int32(n), jnp.float32(share)))
        checked += 1
    assert checked >= 20


def test_a_long_match_is_copied_and_slots_past_the_root_are_ignored():
    store = small_store([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 7, 3, 4, 99]])
    history = jnp.asarray([50, 2, 3, 4, 1, 1, 1, 1], jnp.int32)  # root at 3: the text is 50 2 3 4
    chain, cls, found = store_chain(store, history, jnp.int32(3), 5)
    assert np.asarray(chain).tolist() == [5, 6, 7, 8, 9] and bool(found)  # "2 3 4" beats "3 4" (-> 99)
    none, _, found = store_chain(store, jnp.asarray([60, 61, 62], jnp.int32), jnp.int32(2), 4)
    assert np.asarray(none).tolist() == [-1] * 4 and not bool(found)


def test_a_sequence_end_stops_the_chain():
    store = small_store([[1, 2, 3], [9, 9]])
    chain, _, _ = store_chain(store, jnp.asarray([1, 2], jnp.int32), jnp.int32(1), 4)
    assert np.asarray(chain).tolist() == [3, -1, -1, -1]


def test_file_round_trip_and_refusals(tmp_path, monkeypatch):
    monkeypatch.setenv("BASTION_JAX_CACHE", str(tmp_path / "cache"))
    seqs = [[1, 2, 3, 4], [5, 6, 2, 3, 9]]
    first, cont = np.linspace(0.1, 0.9, NUM_CLASSES), np.linspace(0.2, 0.8, NUM_CLASSES)
    path = tmp_path / FILE
    save_datastore(path, seqs, first, cont, vocab_size=10, info={"rows": 2})
    store = load_datastore(path, vocab_size=10)
    assert np.asarray(store.tokens).tolist() == corpus(seqs).tolist()
    assert np.array_equal(np.asarray(store.order), build_order(corpus(seqs)))
    assert np.allclose(np.asarray(store.first), first) and np.allclose(np.asarray(store.cont), cont)
    assert len(list((tmp_path / "cache" / "datastore").glob("*.order.npy"))) == 1  # built once, then read
    again = load_datastore(path, vocab_size=10)
    assert np.array_equal(np.asarray(again.order), np.asarray(store.order))
    with pytest.raises(DatastoreError, match="10-token vocabulary; the target has 12"):
        load_datastore(path, vocab_size=12)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(DatastoreError, match="unreadable datastore"):
        load_datastore(bad)


def test_the_chain_that_promises_more_is_offered():
    """The context's chain (match n = 1, weak) against the datastore's (an 8-token match, strong): the
    datastore's is the one offered alone (`primary`, `tree_chains=1`), counted in its class; with a
    weak datastore class the context's. By default both are offered, the context's first."""
    cfg = LookupConfig(max_ngram=2, first=(0.3, 0.6), cont=(0.5, 0.7), tree_chains=1)
    text = [1, 2, 3, 4, 5, 6, 7, 8, 4]  # root 4: the context matches "4" (-> 5 6 7 8 4 ...)
    store_seq = [1, 2, 3, 4, 5, 6, 7, 8, 4, 20, 21, 22]
    depth = 4
    state = LookupState(jnp.asarray([text + [0, 0]], jnp.int32), jnp.full((1, depth), -1, jnp.int32),
                        jnp.zeros((1,), jnp.int32), jnp.zeros((1, 2 + NUM_CLASSES, 4), jnp.float32))
    root = jnp.asarray([len(text) - 1], jnp.int32)
    strong = small_store([store_seq], first=np.full(NUM_CLASSES, 0.9), cont=np.full(NUM_CLASSES, 0.9))
    got = current_chain(cfg, state, root, strong)
    cls = int(chain_class(jnp.int32(MAX_MATCH), jnp.float32(1.0)))
    assert np.asarray(got.tokens[0]).tolist() == [20, 21, 22, -1]
    assert int(got.order[0]) == 2 + 1 + cls and float(got.first[0]) == pytest.approx(0.9)
    weak = small_store([store_seq], first=np.full(NUM_CLASSES, 0.05), cont=np.full(NUM_CLASSES, 0.1))
    got = current_chain(cfg, state, root, weak)
    assert np.asarray(got.tokens[0]).tolist() == [5, 6, 7, 8] and int(got.order[0]) == 1
    both = current_chain(dataclasses.replace(cfg, tree_chains=2), state, root, strong)
    assert np.asarray(both.tokens[0]).tolist() == [[5, 6, 7, 8], [20, 21, 22, -1]]
    assert np.asarray(both.order[0]).tolist() == [1, 2 + 1 + cls]
    assert np.asarray(both.first[0]) == pytest.approx([0.3, 0.9])
    assert np.asarray(primary(both).tokens[0]).tolist() == [20, 21, 22, -1]


def _answers_store(engine, prompts, tokens) -> Datastore:
    """A datastore of the target's own greedy answers to `prompts` (what `train_drafter data` keeps)."""
    seqs = [list(p) + list(a) for p, a in zip(prompts, tokens)]
    return small_store(seqs, first=np.full(NUM_CLASSES, 0.6), cont=np.full(NUM_CLASSES, 0.8))


@pytest.mark.parametrize("mode", ["fixed:8", "bastion"])
def test_engine_copies_from_the_datastore_and_keeps_greedy_output(converted, mode):
    """The target's own answers in the datastore: its chains are accepted from the first step (the
    context lookup alone needs the text to repeat first), tau rises, and the output is still AR's."""
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.testing import ChainsPay, DraftingPays, tiny_drafter_config

    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=8), seed=2)
    prompts = [[5, 9, 11, 40, 41, 5, 9, 11], [7, 3, 20], [12, 60, 61]]
    latency = DraftingPays() if mode.startswith("fixed") else ChainsPay()
    plain = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4, 8), top_k=4, latency=latency)
    ar = plain.generate(prompts, max_new_tokens=32, mode="ar").tokens
    store = _answers_store(plain, prompts, ar)
    with_store = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4, 8), top_k=4, latency=latency,
                        datastore=store)
    base, res = plain.generate(prompts, max_new_tokens=32, mode=mode), with_store.generate(
        prompts, max_new_tokens=32, mode=mode)
    assert base.tokens == ar and res.tokens == ar
    assert res.stats.tau > base.stats.tau + 0.5, (res.stats.tau, base.stats.tau)
    assert res.stats.compilations_after_warmup == 0


def test_engine_samples_with_a_datastore_without_recompiling(converted):
    """At T > 0 the datastore's chains are drafts like any other (each committed token is the target's
    own sample, tests/test_joint_law.py); a new temperature compiles nothing."""
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.sampling import SamplingConfig
    from bastion_jax.testing import DraftingPays, tiny_drafter_config

    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=8), seed=2)
    prompts = [[5, 9, 11, 40], [7, 3, 20]]
    store = small_store([[5, 9, 11, 40, 41, 42, 43], [7, 3, 20, 21, 22]], first=np.full(NUM_CLASSES, 0.6),
                        cont=np.full(NUM_CLASSES, 0.8))
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4, 8), top_k=4, latency=DraftingPays(),
                    datastore=store)
    engine.generate(prompts, max_new_tokens=12, mode="fixed:8", sampling=SamplingConfig(temperature=0.7), seed=1)
    before = engine.compilations
    res = engine.generate(prompts, max_new_tokens=12, mode="fixed:8", sampling=SamplingConfig(temperature=1.3),
                          seed=2)
    assert engine.compilations == before
    vocab = target.config.vocab_size
    assert all(len(t) == 12 and all(0 <= x < vocab for x in t) for t in res.tokens)


def test_a_datastore_needs_the_lookup(converted, tmp_path):
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.testing import tiny_drafter_config

    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=8), seed=2)
    path = tmp_path / FILE
    save_datastore(path, [[1, 2, 3]], np.full(NUM_CLASSES, 0.5), np.full(NUM_CLASSES, 0.5),
                   vocab_size=target.config.vocab_size, info={})
    with pytest.raises(DatastoreError, match="needs the lookup on"):
        Engine(target, drafter=drafter, stop_ids=[-1], lookup=None, datastore=str(path))
    with pytest.raises(DatastoreError, match="no datastore file"):
        Engine(target, drafter=drafter, stop_ids=[-1], datastore=str(tmp_path / "missing.npz"))
    assert Engine(target, drafter=drafter, stop_ids=[-1], lookup=None).datastore is None  # auto: quietly none


def test_build_measures_rates_on_held_out_prompts(tmp_path, monkeypatch):
    """`train_drafter datastore`: every distinct row is stored once; the hit rates come from held-out
    greedy rows measured against the rows of other prompts (a prompt's other answers would flatter
    them)."""
    from bastion_jax.train_drafter import main
    from bastion_jax.training.data import pack_records

    monkeypatch.setenv("BASTION_JAX_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    phrase = [30, 31, 32, 33, 34, 35]  # every answer says it: the chain after its start is right
    records = []
    for i in range(40):
        prompt = [1, 2, int(i)]
        answer = rng.integers(3, 29, 5).tolist() + phrase + rng.integers(3, 29, 5).tolist()
        records += [{"prompt_ids": prompt, "response_ids": answer, "temperature": 0.0},
                    {"prompt_ids": prompt, "response_ids": answer[:-1] + [63], "temperature": 0.7}]  # a twin
    repeats = [dict(r, temperature=0.7) for r in records[::2][:15]]  # exact repeats of greedy rows
    data = pack_records(repeats + records, tmp_path / "d.npz", vocab_size=64)
    out = tmp_path / FILE
    assert main(["datastore", "--data", str(data), "--out", str(out), "--held-out", "10", "--quiet"]) == 0
    store = load_datastore(out, vocab_size=64)
    assert len(np.asarray(store.tokens)) == 1 + sum(1 + len(r["prompt_ids"]) + len(r["response_ids"]) for r in records)
    info = datastore_info(out)
    counts = np.asarray(info["counts"])
    assert info["rows"] == len(records) and info["repeats_dropped"] == len(repeats)
    assert info["held_out_rows"] == 10 and counts[:, 1].sum() > 0
    # Without the twins of held-out prompts, the random tokens around the phrase are mostly missed: far
    # below the hit rate of copying an answer of the same prompt (1.0).
    assert counts[:, 0].sum() / counts[:, 1].sum() < 0.8


def test_missed_datastore_chains_lower_every_datastore_class():
    """A text that does not follow the target's usual phrasing: chains of one datastore class missed,
    and every datastore class's hit rates fall (a request sees each class a few times at most); the
    context's classes keep theirs."""
    from bastion_jax.lookup import probabilities

    cfg = LookupConfig(max_ngram=2, first=(0.3, 0.6), cont=(0.5, 0.7))
    store = small_store([[1, 2, 3]], first=np.full(NUM_CLASSES, 0.5), cont=np.full(NUM_CLASSES, 0.6))
    counts = np.zeros((2 + NUM_CLASSES, 4), np.float32)
    first0, cont0 = (np.asarray(x) for x in probabilities(cfg, jnp.asarray(counts), store))
    assert np.allclose(first0[2:], 0.5) and np.allclose(cont0[2:], 0.6) and np.allclose(first0[:2], (0.3, 0.6))
    counts[2 + 3] = [0, 12, 0, 0]  # twelve chains of class 3, none right
    first, cont = (np.asarray(x) for x in probabilities(cfg, jnp.asarray(counts), store))
    assert (first[2:] < 0.5 * 0.6).all() and np.allclose(first[:2], (0.3, 0.6)) and np.allclose(cont, cont0)


def test_repeats_are_stored_once_keeping_a_greedy_label():
    """A repeat folds into the first copy's place, and a greedy copy's record replaces a sampled one,
    so a prompt answered the same way greedily and by sampling can still measure hit rates."""
    from bastion_jax.training.datastore_build import _distinct

    sampled = {"prompt_ids": [1], "response_ids": [2, 3], "temperature": 0.7}
    greedy = dict(sampled, temperature=0.0)
    other = {"prompt_ids": [1], "response_ids": [2, 4], "temperature": 0.7}
    kept, repeats = _distinct([sampled, other, greedy, dict(other)])
    assert repeats == 2 and kept == [greedy, other]


def test_each_chain_of_a_two_chain_step_is_judged_in_its_own_class():
    """After a step that offered both chains, each one's outcome is counted in its own class: the
    context's (n = 2) got its first two tokens right, the datastore's missed its first."""
    from bastion_jax.lookup import advance

    cfg = LookupConfig(max_ngram=2, first=(0.3, 0.6), cont=(0.5, 0.7))
    n_cls = 2 + NUM_CLASSES
    state = LookupState(jnp.zeros((1, 16), jnp.int32), jnp.asarray([[[5, 6, 7], [9, 6, 7]]], jnp.int32),
                        jnp.asarray([[2, 2 + 1 + 4]], jnp.int32), jnp.zeros((1, n_cls, 4), jnp.float32))
    committed = jnp.asarray([[5, 6, 8]], jnp.int32)
    store = small_store([[1, 2, 3, 4]], first=np.full(NUM_CLASSES, 0.5), cont=np.full(NUM_CLASSES, 0.5))
    new, chain = advance(cfg, state, committed, jnp.asarray([3], jnp.int32), jnp.asarray([3], jnp.int32), store)
    assert new.chain.shape == (1, 2, 3) and chain.tokens.shape == (1, 2, 3)
    counts = np.asarray(new.counts[0])
    np.testing.assert_array_equal(counts[1], [1, 1, 1, 2])  # context: c1 right, c2 right, c3 wrong
    np.testing.assert_array_equal(counts[2 + 4], [0, 1, 0, 0])  # datastore class 4: c1 wrong
    assert counts.sum() == 1 + 1 + 1 + 2 + 1
