"""benchmarks/gate_headroom: the counterfactual acceptance table against the engine's own decoding, and
the policy replays against brute force."""

import numpy as np
import pytest

from benchmarks import gate_headroom as gh

BUCKETS = (1, 4, 8)


class UnitPrices:
    """AR 1.0, a draft 0.25, a tree of b nodes 1.0 + 0.05 b (+ the draft): what `Prices` offers."""

    def context(self, t):
        return t

    def root(self, draft, t):
        return 1.0 + 0.25 * draft

    def tree(self, i, t):
        return self.root(True, t) if BUCKETS[i] == 1 else 1.25 + 0.05 * BUCKETS[i]


def random_table(rng, n: int, most_accepted: int = 4, most_surrogate: float = 3.0):
    """(accepted [n, n_buckets], surrogate [n, n_buckets]) of a made-up answer: nested trees (more
    nodes, no fewer accepted, a larger surrogate), nothing at bucket 1 (the root alone)."""
    acc = np.sort(rng.integers(0, most_accepted, size=(n, len(BUCKETS))), axis=1)
    acc[:, 0] = 0
    sur = np.sort(rng.uniform(0, most_surrogate, size=(n, len(BUCKETS))), axis=1)
    sur[:, 0] = 0
    return acc, sur


def brute_oracle(acc, prices, t=0, tree=True):
    """Every sequence of choices, recursively (tiny answers only)."""
    n = len(acc)
    if t >= n:
        return 0.0
    best = min(prices.root(False, t) + brute_oracle(acc, prices, t + 1, False),
               prices.root(True, t) + brute_oracle(acc, prices, t + 1, True))
    if tree:
        for i in range(1, len(BUCKETS)):
            best = min(best, prices.tree(i, t) + brute_oracle(acc, prices, t + int(acc[t, i]) + 1, True))
    return best


def test_replays_against_brute_force():
    rng = np.random.default_rng(0)
    prices = UnitPrices()
    for _ in range(20):
        n = int(rng.integers(1, 9))
        acc = np.sort(rng.integers(0, 4, size=(n, len(BUCKETS))), axis=1)  # nested trees: more nodes, no fewer accepted
        acc[:, 0] = 0
        oracle = gh.replay_oracle(acc, prices)
        assert oracle == pytest.approx(brute_oracle(acc, prices))
        # fixed:b, stepped by hand
        t, secs, steps = 0, 0.0, 0
        while t < n:
            secs, steps, t = secs + prices.tree(2, t), steps + 1, t + acc[t, 2] + 1
        assert gh.replay_fixed(acc, prices, 2) == (pytest.approx(secs), steps)
        assert oracle <= min(n * 1.0, secs) + 1e-9  # never slower than AR steps or any fixed size
    # Nothing ever accepted: the oracle never drafts.
    assert gh.replay_oracle(np.zeros((5, 3), int), prices) == pytest.approx(5.0)


@pytest.fixture(scope="module")
def tiny_engine(converted):
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.presets import tiny_drafter_config

    target = converted("qwen3")[1]
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=6), seed=1)
    return Engine(target, drafter=drafter, stop_ids=[-1], buckets=BUCKETS, top_k=4, lookup=None)


@pytest.fixture(scope="module")
def head_engine(tiny_engine):
    """The tiny engine's drafter with a strong random recurrent conditioned head, drafting depths 2-3
    from each parent's own law on 6 candidate columns of a reduced draft vocabulary."""
    from test_cond_head import with_head

    from bastion_jax.engine import Engine
    from bastion_jax.speculative import DraftVocab

    target = tiny_engine.target
    ranking = np.random.default_rng(1).permutation(target.config.vocab_size)
    return Engine(target, drafter=with_head(tiny_engine.drafter, 8, seed=5, scale=3.0, recurrent=True),
                  stop_ids=[-1], buckets=BUCKETS, top_k=4, lookup=None, cond_depths=3, cond_candidates=6,
                  draft_vocab=DraftVocab.from_ranking(target, ranking, 48))


@pytest.mark.parametrize("which", ["tiny_engine", "head_engine"])
def test_table_steps_equal_the_engines_fixed_steps(which, request):
    """Replaying fixed:b on the table takes exactly the steps the engine's fixed:b decoding took, with
    the trees drafted as decoding drafts them (through a conditioned head too)."""
    engine = request.getfixturevalue(which)
    prompts = [[5, 9, 11, 40, 41], [7, 3, 20], [60, 61, 62, 63]]
    answers = engine.generate(prompts, max_new_tokens=24, mode="ar").tokens
    trees = gh.tree_pass(engine)
    tables = [gh.acceptance_table(trees, BUCKETS, 24, p, a) for p, a in zip(prompts, answers)]
    accepted = sum(int(acc[:, 1:].sum()) for acc, _ in tables)
    assert accepted > 0  # the random drafter's trees do meet the greedy text sometimes
    for b in (4, 8):
        res = engine.generate(prompts, max_new_tokens=24, mode=f"fixed:{b}")
        assert res.tokens == answers
        steps = sum(gh.replay_fixed(acc, UnitPrices(), BUCKETS.index(b))[1] for acc, _ in tables)
        assert steps == res.stats.row_steps
    for acc, sur in tables:
        assert (np.diff(acc, axis=1) >= 0).all() and (np.diff(sur, axis=1) >= -1e-6).all()  # nested trees


class ToyLatency:
    """step_time / predict as the engine's latency model offers them: AR 1.0 + 0.001 c, a draft 0.3,
    a tree of b nodes 1.2 + 0.02 b."""

    def step_time(self, b, c, draft):
        return (1.0 + 0.001 * c if b == 0 else 1.2 + 0.02 * b) + 0.3 * draft

    def predict(self, b, c):
        return self.step_time(b, c, True)


def test_saved_tables_replay_as_the_live_ones(tmp_path):
    """`--save-tables`: a table and its step prices written and read back replay every policy to the
    same seconds and steps as the live prices (so policies can be tried offline)."""
    from types import SimpleNamespace

    rng = np.random.default_rng(1)
    records, live = {}, {}
    for k in range(3):
        acc, sur = random_table(rng, int(rng.integers(5, 30)))
        prices = gh.Prices(ToyLatency(), BUCKETS, prompt_len=10 + 7 * k)
        records[f"toy/{k}"], live[f"toy/{k}"] = gh.table_record(acc, sur, prices), (acc, sur, prices)
    path = tmp_path / "tables.npz"
    gh.save_tables(path, BUCKETS, records)
    buckets, loaded = gh.load_tables(path)
    assert buckets == BUCKETS and sorted(loaded) == sorted(live)
    engine = SimpleNamespace(buckets=BUCKETS, block_size=6)
    for key, (acc, sur, prices) in live.items():
        acc2, sur2, prices2 = loaded[key]
        assert (acc2 == acc).all() and np.allclose(sur2, sur)
        assert gh.replay_gate(acc2, sur2, prices2, engine) == gh.replay_gate(acc, sur, prices, engine)
        assert gh.replay_fixed(acc2, prices2, 2) == gh.replay_fixed(acc, prices, 2)
        assert gh.replay_oracle(acc2, prices2) == pytest.approx(gh.replay_oracle(acc, prices))


def test_save_tables_to_a_missing_directory_is_one_clear_error(tmp_path, capsys):
    """Refused before any model loads or any answer is generated, not after the whole run."""
    assert gh.main(["--save-tables", str(tmp_path / "missing" / "t.npz"), "--quiet"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--save-tables" in err[0] and "no such directory" in err[0]


def test_batch_replay_of_one_row_is_the_single_row_replay_and_brute_forces_the_rules():
    """`benchmarks.batch_replay`: a batch of one row is `replay_gate`'s replay under every rule (the
    rules differ only in which rows judge a step); fixed:b over a batch, stepped by hand, ends with
    its slowest row; and the rules see what they claim on a batch whose rows differ in pace."""
    from types import SimpleNamespace

    from benchmarks import batch_replay as br

    prices = br.ConstPrices(1.0, 1.25, {4: 1.45, 8: 1.65})
    engine = SimpleNamespace(buckets=BUCKETS, block_size=16)
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(4):
        acc, sur = random_table(rng, int(rng.integers(8, 40)), 5, 4.0)
        rows.append((acc, sur))
        hard = acc.copy(), sur * (np.arange(len(sur)) % 24 >= 12)[:, None]  # stretches where trees never pay
        for rule in br.RULES:
            assert br.replay_batch([hard], BUCKETS, prices, rule, 96) == pytest.approx(
                gh.replay_gate(*hard, prices, engine)[0])
            assert br.replay_batch([(acc, sur)], BUCKETS, prices, rule, 96) == pytest.approx(
                gh.replay_gate(acc, sur, prices, engine)[0])
    t, secs = np.zeros(4, int), 0.0
    while any(t[r] < len(rows[r][0]) for r in range(4)):
        secs += 1.65
        t = [p + min(int(a[p, 2]) + 1, len(a) - p) if p < len(a) else p for (a, _), p in zip(rows, t)]
    assert br.replay_fixed(rows, BUCKETS, prices, 8) == pytest.approx(secs)
    curves = np.array([[0.0, 3.0, 5.0], [0.0, 0.2, 0.3], [0.0, 2.0, 9.0]])
    every, left = np.ones(3, bool), np.array([40, 40, 40])
    np.testing.assert_allclose(br.rule_curve("least", curves, every, left, curves), [0.0, 0.2, 0.3])
    np.testing.assert_allclose(br.rule_curve("mean", curves, every, left, curves), curves.mean(axis=0))
    np.testing.assert_allclose(br.rule_curve("judged", curves, every, left, curves), curves[1])  # the slow row
    like = np.array([[0.0, 1.0, 2.0], [0.0, 1.2, 2.2], [0.0, 0.9, 1.8]])
    np.testing.assert_allclose(br.rule_curve("judged", curves, every, left, like), curves.mean(axis=0))


@pytest.mark.parametrize("args, says", [(["missing.npz", "--prices", "1,2"], "cannot read tables"),
                                        (["tables.npz", "--prices", "1,x,3,4"], "--prices"),
                                        (["tables.npz", "--prices", "1,2"], "needs 4 values"),
                                        (["tables.npz", "--prices", "1,2,3,4", "--batch", "0"], "--batch")])
def test_batch_replay_bad_input_is_one_clear_line(tmp_path, monkeypatch, capsys, args, says):
    from benchmarks import batch_replay as br

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    acc, sur = random_table(rng, 6)
    gh.save_tables("tables.npz", BUCKETS, {"toy/0": gh.table_record(acc, sur, gh.Prices(ToyLatency(), BUCKETS, prompt_len=10))})
    assert br.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and says in err[0], err
