"""Drafter training: the objective against brute force and against inference, a toy run that learns."""

import gzip
import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bastion_jax.checkpoints import load_drafter, random_drafter
from bastion_jax.engine import Engine
from bastion_jax.modeling.cache import KVCache
from bastion_jax.speculative import draft_logits
from bastion_jax.testing import tiny_drafter_config
from bastion_jax.training import (DataError, Objective, TokenDataset, TrainConfig, Trainer, blocks_forward,
                                  check_not_benchmark, loss_vocab, make_blocks, sample_anchors, target_features, walk,
                                  walk_runs)
from bastion_jax.checkpoints.dflash import export_zlab

BLOCK = 4


@pytest.fixture(scope="module")
def pair(converted):
    _, target = converted("qwen3")
    return target, random_drafter(tiny_drafter_config(target.config, num_layers=2, block_size=BLOCK), seed=3)


def random_masks(rng, b, s):
    mask = np.zeros((b, s), bool)
    for i in range(b):
        lo = rng.integers(0, s - 2)
        hi = rng.integers(lo + 1, s + 1)
        mask[i, lo:hi] = True
    return mask


def test_anchors_are_distinct_sorted_candidates():
    rng = np.random.default_rng(0)
    for trial in range(20):
        s, n = 24, int(rng.integers(1, 12))
        mask = random_masks(rng, 3, s)
        anchors, valid = map(np.asarray, sample_anchors(jax.random.key(trial), jnp.asarray(mask), n))
        for row in range(3):
            cands = {p for p in range(s - 1) if mask[row, p] and mask[row, p + 1]}
            got = anchors[row][valid[row]]
            assert len(got) == min(n, len(cands))
            assert set(got) <= cands and len(set(got)) == len(got)
            assert list(got) == sorted(got)
            assert not valid[row][len(got):].any() and (anchors[row][~valid[row]] == 0).all()


def test_anchor_choice_covers_every_candidate():
    mask = jnp.asarray(np.array([[0, 1, 1, 1, 1, 1, 0, 1, 1, 0]], bool))
    seen = {int(sample_anchors(jax.random.key(i), mask, 1)[0][0, 0]) for i in range(200)}
    assert seen == {1, 2, 3, 4, 7}


def test_blocks_match_brute_force():
    rng = np.random.default_rng(1)
    b, s, n, gamma = 2, 16, 5, 2.5
    tokens = rng.integers(4, 90, (b, s)).astype(np.int32)
    mask = random_masks(rng, b, s)
    obj = Objective(block_size=BLOCK, num_anchors=n, gamma=gamma, mask_token_id=95)
    anchors, valid = sample_anchors(jax.random.key(0), jnp.asarray(mask), n)
    blocks = jax.tree.map(np.asarray, make_blocks(jnp.asarray(tokens), jnp.asarray(mask), anchors, valid, obj))
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    for r in range(b):
        for i in range(n):
            p = anchors[r, i]
            assert list(blocks.ids[r, i]) == [tokens[r, p]] + [95] * (BLOCK - 1)
            assert list(blocks.positions[r, i]) == list(range(p, p + BLOCK))
            for k in range(1, BLOCK):
                real = valid[r, i] and p + k < s and mask[r, p + k]
                want = np.exp(-(k - 1) / gamma) if real else 0.0
                assert blocks.weights[r, i, k - 1] == pytest.approx(want)
                if real:
                    assert blocks.labels[r, i, k - 1] == tokens[r, p + k]
            for q in range(BLOCK):
                row = blocks.mask[r, i * BLOCK + q]
                ctx = [j < p and valid[r, i] for j in range(s)]
                own = [j // BLOCK == i for j in range(n * BLOCK)]
                assert list(row) == ctx + own


def test_training_blocks_equal_inference_drafts(pair):
    """Each training block's logits equal a real drafting call with the context strictly before its anchor."""
    target, drafter = pair
    model, d = nnx.merge(target.graphdef, target.state), nnx.merge(drafter.graphdef, drafter.state)
    rng = np.random.default_rng(2)
    s = 20
    tokens = jnp.asarray(rng.integers(4, 90, (2, s)).astype(np.int32))
    mask = np.zeros((2, s), bool)
    mask[0, 5:] = True
    mask[1, 3:15] = True
    obj = Objective(block_size=BLOCK, num_anchors=6, gamma=7.0, mask_token_id=drafter.config.mask_token_id)
    features = target_features(model, tokens, drafter.config.target_layer_ids, jnp.float32)  # [2, S, F]
    run = jax.jit(partial(blocks_forward, obj=obj))
    hidden, blocks = run(d, model.embed_tokens.weight[...], features, tokens, jnp.asarray(mask), jax.random.key(4))
    logits = model.logits(hidden)  # [2, N, B-1, vocab]
    rows, slots = np.nonzero(np.asarray(blocks.valid))
    assert len(rows) >= 8
    anchors = np.asarray(blocks.positions)[rows, slots, 0]  # [A]
    # One drafting call per anchor (batched): features of the whole row are offered as padding-
    # extended context, of which only the first p positions are committed (ctx_len = p).
    feats = features[rows]  # [A, S, F]
    cache = KVCache.create(drafter.config, len(rows), s + BLOCK, jnp.float32)
    want, _ = jax.jit(partial(draft_logits, block_size=BLOCK, mask_token_id=obj.mask_token_id, proposal=None))(
        model, d, cache, feats, jnp.zeros(len(rows), jnp.int32), jnp.asarray(anchors, jnp.int32),
        tokens[rows, anchors])
    np.testing.assert_allclose(np.asarray(logits)[rows, slots], np.asarray(want), atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def toy_data(pair):
    """Greedy continuations of the tiny target: what a drafter for it must learn to predict."""
    target, _ = pair
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(4, 90, 4)) for _ in range(24)]
    out = Engine(target, stop_ids=[-1]).generate(prompts, max_new_tokens=28).tokens
    return [{"prompt_ids": [int(t) for t in p], "response_ids": o} for p, o in zip(prompts, out)]


def test_toy_training_learns_resumes_and_exports(pair, toy_data, tmp_path, monkeypatch):
    target, drafter = pair
    data = TokenDataset(toy_data, seq_len=32, vocab_size=target.config.vocab_size)
    train, val = data.split(4)
    cfg = TrainConfig(steps=60, batch_size=4, seq_len=32, num_anchors=8, lr=1e-2, log_every=10, save_every=30,
                      eval_every=10)
    logs, bests = [], []

    def on_best(params, ev):
        bests.append((ev["step"], ev["walk_tau"]))
        assert jax.tree.structure(params) == jax.tree.structure(drafter.state)

    Trainer(target, drafter, dataclasses_replace(cfg, steps=30), tmp_path, log=logs.append,
            on_best=on_best).fit(train, val, progress=False, trace_dir=tmp_path / "trace")
    # --trace: this call's 6th-8th steps under the profiler, summarised per program (the training step's own)
    traced = json.loads((tmp_path / "trace" / "step-trace.json").read_text())
    steps_traced = {m: v["executions"] for m, v in traced["modules"].items() if "train_step" in m}
    assert list(steps_traced.values()) == [3], traced["modules"].keys()
    assert any(m.startswith("traced 3 training steps") for m in logs)
    trainer = Trainer(target, drafter, cfg, tmp_path, log=logs.append, on_best=on_best)
    trained = trainer.fit(train, val, progress=False)
    assert any("resumed" in m and "step 30" in m for m in logs)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["split"] == "train"]
    assert steps == list(range(10, 61, 10))  # resumed at 30, not restarted
    train_rows = [r for r in rows if r["split"] == "train"]
    # The best validation step is exported each time it improves, across the resume: a record, never a regression.
    val_rows = [r for r in rows if r["split"] == "val"]
    assert [r["step"] for r in val_rows] == list(range(10, 61, 10))
    records = []  # selected by the decoding walk's tau
    for r in val_rows:
        if not records or r["walk_tau"] > records[-1][1]:
            records.append((r["step"], r["walk_tau"]))
    assert bests == records and bests[0][0] == 10
    assert json.loads((tmp_path / "best.json").read_text())["step"] == bests[-1][0]
    # The tiny random target's LM head gives small logits, so the loss moves slowly from log(96)
    # while top-1 accuracy climbs fast.
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.25
    assert train_rows[-1]["acc_first"] > train_rows[0]["acc_first"] + 0.15
    assert train_rows[-1]["accept_len"] > train_rows[0]["accept_len"] + 0.2

    # Export -> z-lab format -> load -> decode: the trained drafter gets accepted, losslessly.
    loaded = load_drafter(export_zlab(drafter.config, trained.state, tmp_path / "export", jnp.float32),
                          target.config)
    prompts = [r["prompt_ids"] for r in toy_data[:4]]
    engine = Engine(target, drafter=loaded, stop_ids=[-1])
    spec = engine.generate(prompts, max_new_tokens=20, mode="dflash")
    assert spec.tokens == Engine(target, stop_ids=[-1]).generate(prompts, max_new_tokens=20).tokens
    untrained = Engine(target, drafter=drafter, stop_ids=[-1]).generate(prompts, max_new_tokens=20, mode="dflash")
    assert spec.stats.tau > untrained.stats.tau and spec.stats.tau > 1.3

    # Validation along the decoding walk takes, row by row, exactly the steps dflash decoding takes
    # on the held-out prompts (their responses are the target's greedy answers), and the trainer's
    # last validation reported that walk's tau.
    model = nnx.merge(target.graphdef, target.state)
    tokens, mask = jnp.asarray(val.tokens), jnp.asarray(val.loss_mask)
    obj = Objective(block_size=BLOCK, num_anchors=8, gamma=7.0, mask_token_id=drafter.config.mask_token_id)
    run, valid = walk_runs(trained.state, loss_vocab(target, None, 0), model.embed_tokens.weight[...],
                           target_features(model, tokens, drafter.config.target_layer_ids, jnp.float32), tokens,
                           mask, drafter_def=trained.graphdef, obj=obj, window=40, matmul_dtype="float32")
    committed = steps = 0  # the walk counts tokens within the budget (the engine's last step may run over)
    for i in range(len(val)):
        start, length = int(np.argmax(val.loss_mask[i])), int(val.loss_mask[i].sum())
        st = engine.generate([[int(t) for t in val.tokens[i, :start]]], max_new_tokens=length, mode="dflash").stats
        assert walk(np.asarray(run[i:i + 1]), np.asarray(valid[i:i + 1])) == (st.new_tokens - 1, st.steps)
        committed, steps = committed + st.new_tokens - 1, steps + st.steps
    assert steps < committed - len(val)  # drafts were accepted: the walks are not all single steps
    assert val_rows[-1]["walk_tau"] == pytest.approx(committed / steps)
    # In calls of 3 rows (the last one padded with a repeated row), the same walks.
    monkeypatch.setattr("bastion_jax.training.trainer.rows_per_call", lambda *a: 3)
    assert trainer.walk_tau(trained.state, val, trainer.feature_store(val, "val")) == pytest.approx(committed / steps)


def test_a_continued_drafter_is_the_record_to_beat(pair, toy_data, tmp_path, monkeypatch):
    """`validate_start` validates the starting weights as step 0: a run that cannot improve on them
    (learning rate 0 at every step) keeps step 0 as its best, and one that learns replaces it."""
    target, drafter = pair
    train, val = TokenDataset(toy_data, seq_len=32, vocab_size=target.config.vocab_size).split(4)
    cfg = TrainConfig(steps=20, batch_size=4, seq_len=32, num_anchors=8, lr=1e-2, weight_decay=0.0, log_every=10,
                      save_every=20, eval_every=10)
    for lr, name in ((0.0, "frozen"), (1e-2, "learning")):
        bests = []
        if lr == 0.0:  # (TrainConfig refuses lr 0: the schedule is zeroed instead)
            monkeypatch.setattr("bastion_jax.training.trainer.learning_rate", lambda cfg, progress: 0.0)
        else:
            monkeypatch.undo()
        Trainer(target, drafter, cfg, tmp_path / name, log=lambda m: None,
                on_best=lambda params, ev: bests.append(ev["step"])).fit(train, val, progress=False, validate_start=True)
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        val_rows = [r for r in rows if r["split"] == "val"]
        assert [r["step"] for r in val_rows] == [0, 10, 20]
        best = json.loads((tmp_path / name / "best.json").read_text())
        if lr == 0.0:
            assert bests == [0] and best["step"] == 0 and val_rows[2]["walk_tau"] == val_rows[0]["walk_tau"]
        else:
            assert bests[0] == 0 and best["step"] > 0 and best["walk_tau"] > val_rows[0]["walk_tau"]


def test_validation_reads_the_same_rows_whatever_the_batch_size(pair, toy_data, tmp_path, monkeypatch):
    """Teacher-forced validation covers every held-out row (up to VAL_ROWS) once, at any batch size:
    it used to read 4 batches, i.e. 4 rows at batch 1 and 128 at batch 32."""
    import bastion_jax.training.trainer as trainer_module

    target, drafter = pair
    train, val = TokenDataset(toy_data, seq_len=32, vocab_size=target.config.vocab_size).split(12)
    assert len(val) == 12  # more than 4 batches of 2
    seen = []
    real = trainer_module.batch_indices

    def spy(*args, **kwargs):
        for idx in real(*args, **kwargs):
            seen.append(idx.copy())
            yield idx

    monkeypatch.setattr(trainer_module, "batch_indices", spy)
    for bs in (2, 4):
        seen.clear()
        cfg = TrainConfig(steps=1, batch_size=bs, seq_len=32, num_anchors=8, walk_rows=0)
        ev = Trainer(target, drafter, cfg, tmp_path / str(bs), log=lambda m: None).evaluate(drafter.state, val)
        assert sorted(np.concatenate(seen).tolist()) == list(range(12)) and "walk_tau" not in ev
    seen.clear()
    cfg = TrainConfig(steps=1, batch_size=2, seq_len=32, num_anchors=8, walk_rows=0)
    Trainer(target, drafter, cfg, tmp_path / "cap", log=lambda m: None).evaluate(drafter.state, val, rows=6)
    assert len(np.concatenate(seen)) == 6


class FakeClock:
    """Stands in for the trainer's `time` module: every `perf_counter()` reading is `tick` seconds later,
    so wall-time rules run the same on any machine."""

    def __init__(self, tick: float):
        self.t, self.tick = 0.0, tick

    def perf_counter(self) -> float:
        self.t += self.tick
        return self.t


def test_learning_rate_follows_the_dflash_schedule():
    """The injected rate equals optax's warm-up + cosine schedule (to 10%) at every step, and a
    wall-time progress past the step count moves it on."""
    import optax

    from bastion_jax.training.optim import learning_rate

    cfg = TrainConfig(steps=200, lr=6e-4, warmup_ratio=0.04)
    ref = optax.warmup_cosine_decay_schedule(0.0, 6e-4, 8, 200, 6e-5)
    for step in range(0, 201, 7):
        assert learning_rate(cfg, step / 200) == pytest.approx(float(ref(step)), rel=1e-5, abs=1e-9)
    assert learning_rate(cfg, 1.0) == pytest.approx(6e-5)
    assert learning_rate(cfg, 0.9) < learning_rate(cfg, 0.5)


def test_max_seconds_stops_resumably_and_anneals(pair, toy_data, tmp_path, monkeypatch):
    """A wall-time limit ends the run at a step boundary with a validation, a checkpoint and an
    annealed rate (wall-time progress, far ahead of the step count, drove the schedule through
    warm-up and decay); a rerun resumes there. A fake clock makes it independent of machine speed."""
    from bastion_jax.training import trainer as trainer_module

    target, drafter = pair
    train, val = TokenDataset(toy_data, seq_len=32, vocab_size=target.config.vocab_size).split(4)
    cfg = TrainConfig(steps=100_000, batch_size=4, seq_len=32, num_anchors=8, lr=1e-2, log_every=10,
                      save_every=50_000, eval_every=50_000)
    rates, seen = [], []
    real = trainer_module.set_learning_rate
    monkeypatch.setattr(trainer_module, "time", FakeClock(0.01))  # every reading 10 ms later
    monkeypatch.setattr(trainer_module, "set_learning_rate", lambda s, lr: rates.append(lr) or real(s, lr))
    Trainer(target, drafter, cfg, tmp_path, log=seen.append).fit(train, val, progress=False, max_seconds=1.0)
    stopped = len(rates)
    assert 10 <= stopped < 100 and any("--max-seconds reached" in m for m in seen)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["split"] == "val" and rows[-1]["step"] == stopped
    assert rates[0] < 0.5 * cfg.lr and max(rates) > 0.9 * cfg.lr and rates[-1] < 0.15 * cfg.lr
    monkeypatch.undo()
    seen.clear()
    later = []
    monkeypatch.setattr(trainer_module, "set_learning_rate", lambda s, lr: later.append(lr) or real(s, lr))
    Trainer(target, drafter, dataclasses_replace(cfg, steps=stopped + 2), tmp_path, log=seen.append).fit(
        train, val, progress=False)
    assert any("resumed" in m and f"step {stopped}" in m for m in seen)
    assert len(later) == 2 and max(later) < 0.15 * cfg.lr  # it goes on annealed, no jump back to the peak


def test_checkpoints_follow_the_clock_as_well_as_the_steps(pair, toy_data, tmp_path, monkeypatch):
    """`save_minutes`: a checkpoint whenever that much time passed since the last one, whatever
    `save_every` says (a slow CPU run would otherwise lose up to `save_every` steps to a session's end);
    0 keeps the step rule alone. A fake clock (every reading 10 s later) makes it exact."""
    from bastion_jax.training import trainer as trainer_module

    target, drafter = pair
    train, _ = TokenDataset(toy_data, seq_len=32, vocab_size=target.config.vocab_size).split(4)
    monkeypatch.setattr(trainer_module, "time", FakeClock(10.0))
    real = Trainer._save
    for minutes, want in ((0.0, [5]), (0.4, [1, 2, 3, 4, 5]), (60.0, [5])):
        saved = []
        monkeypatch.setattr(Trainer, "_save", lambda self, mngr, step, *a: saved.append(step) or real(self, mngr, step, *a))
        cfg = TrainConfig(steps=5, batch_size=4, seq_len=32, num_anchors=8, lr=1e-2, save_every=50_000,
                          save_minutes=minutes)
        Trainer(target, drafter, cfg, tmp_path / str(minutes), log=lambda m: None).fit(train, progress=False)
        assert saved == want, (minutes, saved)


def test_averaged_weights_are_validated_exported_and_resumed(pair, toy_data, tmp_path, monkeypatch):
    """`TrainConfig.ema`: the run validates, hands `on_best` and returns the average
    e_t = d e_(t-1) + (1 - d) p_t begun at the starting weights; a resumed run continues the
    checkpointed average (not a new one), and one resumed from a checkpoint without it starts there."""
    from bastion_jax.training import trainer as trainer_module

    target, drafter = pair
    train, val = TokenDataset(toy_data, seq_len=32, vocab_size=target.config.vocab_size).split(4)
    cfg = TrainConfig(steps=2, batch_size=4, seq_len=32, num_anchors=8, lr=1e-2, log_every=1, save_every=1, ema=0.5)
    trained, real = [], trainer_module.train_step

    def recording(*a, **k):  # the weights after each step
        out = real(*a, **k)
        trained.append(jax.tree.map(np.array, out[0]))
        return out

    monkeypatch.setattr(trainer_module, "train_step", recording)
    leaves = lambda tree: [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]
    mix = lambda a, b: [0.5 * x + 0.5 * y for x, y in zip(a, b)]

    def close(a, b):
        return all(np.allclose(x, y, atol=1e-6) for x, y in zip(a, b))

    handed = []
    first = Trainer(target, drafter, cfg, tmp_path / "ema", log=lambda m: None,
                    on_best=lambda params, ev: handed.append(leaves(params))).fit(train, val, progress=False)
    p0 = leaves(drafter.state)
    e2 = mix(mix(p0, leaves(trained[0])), leaves(trained[1]))
    assert close(leaves(first.state), e2) and not close(e2, leaves(trained[1]))
    assert len(handed) == 1 and close(handed[0], e2)  # validation read the average, not the last step
    logs = []
    later = Trainer(target, drafter, dataclasses_replace(cfg, steps=3), tmp_path / "ema", log=logs.append).fit(
        train, progress=False)
    assert any("resumed" in m for m in logs) and len(trained) == 3
    assert close(leaves(later.state), mix(e2, leaves(trained[2])))

    plain = dataclasses_replace(cfg, ema=0.0)
    Trainer(target, drafter, plain, tmp_path / "plain", log=lambda m: None).fit(train, progress=False)
    assert len(trained) == 5
    logs.clear()
    switched = Trainer(target, drafter, dataclasses_replace(cfg, steps=3), tmp_path / "plain", log=logs.append).fit(
        train, progress=False)
    assert any("no averaged weights" in m for m in logs)
    assert close(leaves(switched.state), mix(leaves(trained[4]), leaves(trained[5])))
    with pytest.raises(ValueError, match="ema must be in"):
        TrainConfig(steps=1, ema=1.0)


def test_a_checkpoint_of_another_layout_is_refused_in_one_line(pair, toy_data, tmp_path):
    target, drafter = pair
    train, _ = TokenDataset(toy_data, seq_len=32, vocab_size=target.config.vocab_size).split(4)
    cfg = TrainConfig(steps=2, batch_size=4, seq_len=32, num_anchors=8, save_every=2)
    Trainer(target, drafter, cfg, tmp_path, log=lambda m: None).fit(train, progress=False)
    other = random_drafter(tiny_drafter_config(target.config, num_layers=1, block_size=BLOCK), seed=3)
    with pytest.raises(ValueError, match="does not fit this run.*--init"):
        Trainer(target, other, dataclasses_replace(cfg, steps=4), tmp_path, log=lambda m: None).fit(train,
                                                                                                progress=False)


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


@pytest.mark.parametrize("name", ["gsm8k_test.jsonl.gz", "humaneval.jsonl.gz", "mt_bench_questions.jsonl.gz",
                                  "eagle_gsm8k_questions.jsonl.gz", "aime24_test.jsonl.gz"])
def test_benchmark_sets_are_refused(name):
    with pytest.raises(DataError, match="benchmark"):
        check_not_benchmark(f"/somewhere/{name}")


def test_training_splits_are_accepted():
    check_not_benchmark("gsm8k_train.jsonl.gz")
    check_not_benchmark("code_alpaca_2k.jsonl.gz")


def test_bad_datasets():
    with pytest.raises(DataError, match="empty"):
        TokenDataset([], 16, 96)
    with pytest.raises(DataError, match="vocabulary"):
        TokenDataset([{"prompt_ids": [1, 2], "response_ids": [500, 3]}], 16, 96)
    with pytest.raises(DataError, match="prompt_ids"):
        TokenDataset([{"tokens": [1, 2]}], 16, 96)
    with pytest.raises(DataError, match="no record has a response"):
        TokenDataset([{"prompt_ids": list(range(4, 40)), "response_ids": [5, 6]}], 16, 96)
    with pytest.raises(ValueError, match="num_anchors"):
        TrainConfig(steps=1, seq_len=16, num_anchors=16)


def test_cli_data_then_train(tmp_path, capsys):
    """The two commands end to end on a tiny HF target: responses, training, z-lab export."""
    from bastion_jax.checkpoints import load_target
    from bastion_jax.testing import save_tiny_hf
    from bastion_jax.train_drafter import main

    save_tiny_hf("qwen3", tmp_path / "hf")
    prompts = tmp_path / "my_train_split.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(4, 20)))
    common = ["--target", str(tmp_path / "hf"), "--quiet"]
    assert main(["data", *common, "--out", str(tmp_path / "d.jsonl"), "--sources", str(prompts), "--stdlib", "0",
                 "--num", "12", "--max-new-tokens", "12", "--batch-size", "6"]) == 0
    lines = (tmp_path / "d.jsonl").read_text().splitlines()
    assert len(lines) == 12 and all(1 <= len(json.loads(x)["response_ids"]) <= 12 for x in lines)
    assert main(["train", *common, "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "run"),
                 "--layers", "1", "--block-size", "4", "--steps", "3", "--batch-size", "2", "--seq-len", "16",
                 "--anchors", "4", "--held-out", "2", "--export-dtype", "float32"]) == 0
    # A --reuse-features directory that does not exist is one error line, not silently ignored.
    assert main(["train", *common, "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "run2"),
                 "--reuse-features", str(tmp_path / "nowhere")]) != 0
    assert "--reuse-features: no such directory" in capsys.readouterr().err
    # --resume without a checkpoint to continue is refused; with one it continues (the run's 3 steps are done).
    assert main(["train", *common, "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "run3"),
                 "--resume"]) == 2
    assert "--resume: no checkpoint to continue" in capsys.readouterr().err
    logged = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert main(["train", *common, "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "run"),
                 "--layers", "1", "--block-size", "4", "--steps", "3", "--batch-size", "2", "--seq-len", "16",
                 "--anchors", "4", "--held-out", "2", "--export-dtype", "float32", "--resume"]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == logged  # continued at step 3: nothing retrained
    target = load_target(tmp_path / "hf", jnp.float32)
    drafter = load_drafter(tmp_path / "run" / "drafter", target.config)
    assert drafter.config.block_size == 4 and drafter.config.num_hidden_layers == 1
    assert json.loads((tmp_path / "run" / "drafter" / "training.json").read_text())["train_config"]["steps"] == 3
    best = json.loads((tmp_path / "run" / "best" / "training.json").read_text())["validation"]
    assert best == json.loads((tmp_path / "run" / "best.json").read_text()) and best["step"] == 3
    assert load_drafter(tmp_path / "run" / "best", target.config).config.block_size == 4
    # --init continues a drafter: validated first (step 0), the record its trained steps must beat.
    assert main(["train", *common, "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "run4"),
                 "--init", str(tmp_path / "run" / "drafter"), "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                 "--anchors", "4", "--held-out", "2", "--eval-every", "2", "--export-dtype", "float32"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run4" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "val"] == [0, 2]
    marginal = lambda run: json.loads((tmp_path / run / "drafter" / "training.json").read_text())[  # noqa: E731
        "train_config"]["marginal"]
    assert marginal("run4") == 0.0  # no head: nothing to weigh beside it
    # A head trained with its drafter keeps the drafter's own law trained too unless told otherwise.
    head = ["--init", str(tmp_path / "run" / "drafter"), "--cond-head", "8", "--steps", "1", "--batch-size", "2",
            "--seq-len", "16", "--anchors", "4", "--held-out", "2", "--walk-rows", "0", "--export-dtype", "float32"]
    assert main(["train", *common, "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "run6"), *head]) == 0
    assert marginal("run6") == 1.0
    assert main(["train", *common, "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "run7"), *head,
                 "--marginal", "0"]) == 0
    assert marginal("run7") == 0.0
    # A flag that shapes a new drafter is refused with --init (which keeps its own), not ignored.
    assert main(["train", *common, "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "run5"),
                 "--init", str(tmp_path / "run" / "drafter"), "--intermediate-size", "32"]) != 0
    assert "--intermediate-size sets a new drafter's shape; an --init drafter keeps its own" in capsys.readouterr().err

    # eval: tau per mode and prompt set, AR identity checked, the report written.
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"turns": [f"w{i} w{i + 3}", "second turn"]}) + "\n" for i in range(5, 10)))
    code = tmp_path / "code.jsonl.gz"
    with gzip.open(code, "wt") as f:
        f.writelines(json.dumps({"prompt": f"w{i} w{i}"}) + "\n" for i in range(30, 33))
    assert main(["eval", *common, "--drafter", str(tmp_path / "run" / "drafter"), "--prompts", str(chat), str(code),
                 "--max-prompts", "4", "--max-new-tokens", "10", "--modes", "dflash,fixed:4", "--buckets", "1,4",
                 "--batch-size", "3", "--out", str(tmp_path / "acc")]) == 0
    report = json.loads((tmp_path / "acc.json").read_text())
    assert report["meta"]["prompts"] == {"chat": 4, "code": 3}
    for name in ("chat", "code"):
        for mode in ("dflash", "fixed:4"):
            row = report["tau"][name][mode]
            assert row["identical_to_ar"] is True and row["steps"] > 0
            assert row["tau"] == pytest.approx(row["committed"] / row["steps"]) and 1.0 <= row["tau"] <= 4.0
    md = (tmp_path / "acc.md").read_text()
    assert "| set | dflash | fixed:4 |" in md and "| chat |" in md and "identical to AR: yes" in md
    assert main(["eval", *common, "--drafter", str(tmp_path / "run" / "drafter"), "--prompts",
                 str(tmp_path / "missing.jsonl")]) == 2


def test_cli_refuses_benchmark_sources(tmp_path, capsys):
    from bastion_jax.testing import save_tiny_hf
    from bastion_jax.train_drafter import main

    save_tiny_hf("qwen3", tmp_path / "hf")
    bench = tmp_path / "gsm8k_test.jsonl"
    bench.write_text(json.dumps({"question": "w4"}) + "\n")
    assert main(["data", "--target", str(tmp_path / "hf"), "--out", str(tmp_path / "d.jsonl"), "--sources",
                 str(bench), "--stdlib", "0", "--quiet"]) == 2
    assert "held-out benchmark" in capsys.readouterr().err


def test_preferred_anchors_are_drawn_by_weight():
    """`sample_anchors(prefer=, prefer_weight=W)` samples without replacement with weights W and 1:
    one anchor of 18 candidates, two of them preferred with W = 5, lands on each preferred one with
    probability 5 / 26; without a preference (or W = 1) the draw is the uniform one, anchor for anchor."""
    rows, s = 4000, 20
    mask = np.zeros((rows, s), bool)
    mask[:, 1:20] = True  # candidates 1..18
    prefer = np.zeros((rows, s), bool)
    prefer[:, [3, 7]] = True
    key = jax.random.key(0)
    anchors, _ = sample_anchors(key, jnp.asarray(mask), 1, jnp.asarray(prefer), 5.0)
    freq = np.bincount(np.asarray(anchors)[:, 0], minlength=s) / rows
    p, sd = 5 / 26, np.sqrt(5 / 26 * 21 / 26 / rows)
    assert abs(freq[3] - p) < 4 * sd and abs(freq[7] - p) < 4 * sd
    assert abs(freq[[1, 2, 4, 5, 6] + list(range(8, 19))].mean() - 1 / 26) < 0.01
    uniform = np.asarray(sample_anchors(key, jnp.asarray(mask), 3)[0])
    np.testing.assert_array_equal(uniform, np.asarray(sample_anchors(key, jnp.asarray(mask), 3, jnp.asarray(prefer),
                                                                     1.0)[0]))


def test_first_misses_match_brute_force():
    """The position of each block's first wrong draft on a response token (none for a full run, one
    that ends on a non-response label, or an invalid block), as decoding would anchor next."""
    from bastion_jax.training.objective import first_misses

    rng = np.random.default_rng(1)
    s, n, b = 40, 6, 3
    mask = random_masks(rng, b, s)
    obj = Objective(block_size=BLOCK, num_anchors=n, gamma=4.0, mask_token_id=0)
    tokens = jnp.asarray(rng.integers(1, 50, (b, s)), jnp.int32)
    anchors, valid = sample_anchors(jax.random.key(2), jnp.asarray(mask), n)
    blocks = make_blocks(tokens, jnp.asarray(mask), anchors, valid, obj)
    correct = rng.random((b, n, BLOCK - 1)) < 0.6
    got = np.asarray(first_misses(blocks, jnp.asarray(correct) & blocks.real, s))
    want = np.zeros((b, s), bool)
    real = np.asarray(blocks.real)
    for i in range(b):
        for j in range(n):
            if not valid[i, j]:
                continue
            for k in range(BLOCK - 1):
                if not (correct[i, j, k] and real[i, j, k]):
                    if real[i, j, k]:
                        want[i, int(anchors[i, j]) + 1 + k] = True
                    break
    assert want.any() and (~want).any()
    np.testing.assert_array_equal(got, want)


def test_anchors_follow_the_last_visits_misses(pair, toy_data, tmp_path, monkeypatch):
    """With `miss_weight`, the run first marks every row's first misses under its starting weights,
    each step hands back its rows' misses and the next visit of those rows draws its anchors
    preferring them. Without it the step gets no preference."""
    from bastion_jax.training import trainer as trainer_module

    target, drafter = pair
    train = TokenDataset(toy_data[:8], seq_len=32, vocab_size=target.config.vocab_size)
    calls, real = [], trainer_module.train_step

    def recording(*a, **k):
        out = real(*a, **k)
        calls.append((None if a[8] is None else np.asarray(a[8]), np.asarray(a[5]), np.asarray(a[6]),
                      None if out[3] is None else np.asarray(out[3])))
        return out

    monkeypatch.setattr(trainer_module, "train_step", recording)
    cfg = TrainConfig(steps=3, batch_size=8, seq_len=32, num_anchors=8, lr=1e-2, log_every=1, save_every=10,
                      miss_weight=4.0)
    Trainer(target, drafter, cfg, tmp_path / "w", log=lambda m: None).fit(train, progress=False)
    last = {}  # row tokens -> the misses its last visit handed back
    for prefer, tokens, loss_mask, seen in calls:
        if last:
            np.testing.assert_array_equal(prefer, [last[t.tobytes()] for t in tokens])
        assert prefer.any() and not (prefer & ~loss_mask).any()
        assert seen.any() and not (seen & ~loss_mask).any()
        last.update({t.tobytes(): m for t, m in zip(tokens, seen)})
    # The first visits prefer the misses of the starting weights, marked before the first step.
    trainer = Trainer(target, drafter, cfg, tmp_path / "m", log=lambda m: None)
    trainer.prepare(train)
    marked = trainer.mark_misses(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), drafter.state), train,
                                 trainer.feature_store(train, "train"), progress=False)
    first = {t.tobytes(): m for t, m in zip(train.tokens, marked)}
    np.testing.assert_array_equal(calls[0][0], [first[t.tobytes()] for t in calls[0][1]])
    Trainer(target, drafter, dataclasses_replace(cfg, miss_weight=1.0), tmp_path / "u", log=lambda m: None).fit(
        train, progress=False)
    assert calls[3][0] is None and calls[3][3] is None
    with pytest.raises(ValueError, match="miss_weight must be > 0"):
        TrainConfig(steps=1, miss_weight=0.0)
