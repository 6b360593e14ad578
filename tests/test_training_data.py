"""Drafter training data: Magpie self-written prompts, sampled responses, compact packed storage."""

import json

import numpy as np
import pytest

from bastion_jax.testing import tiny_tokenizer
from bastion_jax.training.data import (DataError, TokenDataset, batch_seed, magpie_prompts, pack_records,
                                       read_packed, read_records, user_turn_prefix)

CHAT = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<s> assistant {% endif %}")


def chat_tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = CHAT
    return tok


def test_user_turn_prefix_is_the_template_up_to_the_message():
    tok = chat_tokenizer()
    vocab = tok.get_vocab()
    # "<s> user w7 </s>" rendered with the message w7: the prefix stops right before w7.
    assert user_turn_prefix(tok) == [vocab["<s>"], tok.unk_token_id]  # "user" is not in the toy vocabulary
    with_system = user_turn_prefix(tok, system="w9")
    assert with_system[:4] == [vocab["<s>"], tok.unk_token_id, vocab["w9"], vocab["</s>"]]


def test_user_turn_prefix_refuses_templates_that_rewrite_the_message():
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(DataError, match="Magpie"):
        user_turn_prefix(tok)


class FakeEngine:
    """Returns scripted token lists so the Magpie filter (stop token, length, repeats) is checked exactly."""

    stop_ids = frozenset({2})

    def __init__(self, batches):
        self.batches = list(batches)
        self.seeds = []
        self.prompts = []

    def generate(self, prompts, *, max_new_tokens, mode, sampling, seed):
        from types import SimpleNamespace

        assert mode == "ar" and sampling.temperature == 1.0
        self.seeds.append(seed)
        self.prompts.append([list(p) for p in prompts])
        return SimpleNamespace(tokens=self.batches.pop(0))


def test_magpie_filters_and_resumes(tmp_path):
    tok = chat_tokenizer()
    words = lambda *ids: [tok.get_vocab()[f"w{i}"] for i in ids]  # noqa: E731
    long_q = words(*range(10, 20))
    batches = [
        [long_q + [2], long_q + [2], words(5) + [2], long_q[:5] + words(30, 31, 32, 33, 34)],  # repeat, short, no stop
        [words(*range(40, 50)) + [2], words(*range(50, 60)) + [2], [], [2]],
    ]
    out = tmp_path / "m.jsonl"
    engine = FakeEngine(batches)
    got = magpie_prompts(engine, tok, 2, out, batch_size=4, seed=7, progress=False)
    assert got == [tok.decode(long_q), tok.decode(words(*range(40, 50)))]
    assert engine.seeds == [batch_seed(7, 0), batch_seed(7, 1)]
    assert [json.loads(line)["prompt"] for line in open(out)] == got
    # A rerun with the file present generates nothing more.
    again = FakeEngine([])
    assert magpie_prompts(again, tok, 2, out, batch_size=4, seed=7, progress=False) == got
    assert again.seeds == []


def test_magpie_openers_start_each_user_turn(tmp_path):
    """With openers, every row's prompt is the user prefix + one opener, drawn per batch from the seed,
    and the kept prompt is the opener followed by what the target wrote."""
    tok = chat_tokenizer()
    vocab = tok.get_vocab()
    openers = ("w4", "w5 w6", "w7")
    body = [vocab[f"w{i}"] for i in range(20, 30)]
    rows = lambda lo: [body[i:] + body[:i] + [2] for i in range(lo, lo + 4)]  # noqa: E731  distinct turns
    engine = FakeEngine([rows(0), rows(4)])
    got = magpie_prompts(engine, tok, 8, tmp_path / "m.jsonl", batch_size=4, seed=3, progress=False,
                         openers=openers)
    prefix = user_turn_prefix(tok)
    starts = {tuple(tok(o, add_special_tokens=False)["input_ids"]): o for o in openers}
    drawn = []
    for batch, written in zip(engine.prompts, [got[:4], got[4:]]):
        for prompt, text in zip(batch, written):
            assert prompt[:len(prefix)] == prefix
            opener = starts[tuple(prompt[len(prefix):])]  # exactly one opener follows the prefix
            assert text.startswith(opener + " w2")
            drawn.append(opener)
    assert len(set(drawn)) > 1  # drawn per row, not one opener for the whole run
    again = FakeEngine([rows(0), rows(4)])
    magpie_prompts(again, tok, 8, tmp_path / "again.jsonl", batch_size=4, seed=3, progress=False, openers=openers)
    assert again.prompts == engine.prompts  # the same seed draws the same openers


def test_neighbouring_seeds_draw_unrelated_batches(tmp_path):
    """Runs with seeds s and s + 1 must not share batches: with `seed + batch` they did (run s's batch 1
    was run s+1's batch 0), and five chat sets made that way repeated each other row for row."""
    seeds = {batch_seed(s, i) for s in range(10, 20) for i in range(200)}
    assert len(seeds) == 10 * 200
    assert batch_seed(3, 1) == batch_seed(3, 1)  # deterministic: a resumed run draws what it would have
    tok = chat_tokenizer()
    body = [tok.get_vocab()[f"w{i}"] for i in range(20, 30)]
    turns = [[body[i:] + body[:i] + [2] for i in range(j, j + 4)] for j in (0, 4)]
    a, b = FakeEngine(turns), FakeEngine([t[:] for t in turns])
    magpie_prompts(a, tok, 8, tmp_path / "a.jsonl", batch_size=4, seed=10, progress=False, openers=("w4", "w5", "w7"))
    magpie_prompts(b, tok, 8, tmp_path / "b.jsonl", batch_size=4, seed=11, progress=False, openers=("w4", "w5", "w7"))
    assert not set(a.seeds) & set(b.seeds)


def test_exact_repeats_are_one_row_kept_at_their_last_place():
    """A row repeated across files is trained on once, and a repeat of a held-out (last) row never stays
    in the training part."""
    rec = lambda p, r: {"prompt_ids": p, "response_ids": r}  # noqa: E731
    rows = [rec([1, 2], [3, 4]), rec([5], [6, 7]), rec([1, 2], [3, 4]), rec([1], [2, 3, 4]),
            rec([8], [9, 10]), rec([5], [6, 7])]
    data = TokenDataset(rows, seq_len=8, vocab_size=16)
    assert data.duplicates == 2
    assert len(data) == 4
    # [1, 2 | 3, 4] and [1 | 2, 3, 4] share tokens but not the response start: both stay
    assert data.tokens[:, :4].tolist() == [[1, 2, 3, 4], [1, 2, 3, 4], [8, 9, 10, 0], [5, 6, 7, 0]]
    assert data.loss_mask[:2, :4].tolist() == [[False, False, True, True], [False, True, True, True]]
    train, val = data.split(1)
    assert val.tokens[0, :3].tolist() == [5, 6, 7]
    assert not any((t == val.tokens[0]).all() for t in train.tokens)
    # cut to seq_len, rows that differ only after it are one example
    assert TokenDataset([rec([1], [2, 3, 4]), rec([1], [2, 3, 5])], seq_len=3, vocab_size=16).duplicates == 1


def test_pack_round_trip_is_exact_and_compact(tmp_path):
    rng = np.random.default_rng(0)
    records = [{"source": s, "prompt_ids": rng.integers(0, 49152, n).tolist(),
                "response_ids": rng.integers(0, 49152, m).tolist(), "temperature": t}
               for s, n, m, t in [("gsm8k_train", 30, 50, 0.0), ("magpie", 12, 0, 0.7), ("code", 1, 200, 0.0)]]
    path = pack_records(records, tmp_path / "d.npz", vocab_size=49152)
    assert np.load(path)["tokens"].dtype == np.uint16
    back = read_packed(path)
    assert [r["prompt_ids"] for r in back] == [r["prompt_ids"] for r in records]
    assert [r["response_ids"] for r in back] == [r["response_ids"] for r in records]
    assert [(r["source"], r["temperature"]) for r in back] == [(r["source"], pytest.approx(r["temperature"]))
                                                             for r in records]
    assert read_records(path) == back
    big = pack_records(records[:1], tmp_path / "big.npz", vocab_size=70000)
    assert np.load(big)["tokens"].dtype == np.uint32
    data = TokenDataset.from_files([path], seq_len=64, vocab_size=49152)
    assert len(data) == 2  # the response-less record has no anchor


def test_packed_file_errors(tmp_path):
    bad = tmp_path / "x.npz"
    np.savez(bad, tokens=np.zeros(3, np.uint16))
    with pytest.raises(DataError, match="not a packed token file"):
        read_packed(bad)


def test_cli_pack_and_unpack_round_trip(tmp_path):
    from bastion_jax.train_drafter import main

    records = [{"source": "gsm8k_train", "prompt_ids": [1, 2, 3], "response_ids": [4, 5], "temperature": 0.0},
               {"source": "magpie", "prompt_ids": [7], "response_ids": [8, 9, 10], "temperature": 0.7}]
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["pack", "--data", str(src), "--out", str(tmp_path / "d.npz"), "--quiet"]) == 0
    assert main(["pack", "--data", str(tmp_path / "d.npz"), "--out", str(tmp_path / "back.jsonl"), "--quiet"]) == 0
    back = [json.loads(line) for line in open(tmp_path / "back.jsonl")]
    assert [(r["source"], r["prompt_ids"], r["response_ids"]) for r in back] == [
        (r["source"], r["prompt_ids"], r["response_ids"]) for r in records]


def test_responses_keep_one_cache_length_across_batches(tmp_path, converted):
    """Every batch decodes with the same KV cache length, whatever its longest prompt: sized per batch,
    each new length compiled another decode step (most of a GPU data run's time)."""
    from bastion_jax.engine import Engine
    from bastion_jax.training.data import generate_responses

    _, target = converted("llama3")
    tok = chat_tokenizer()
    engine = Engine(target, tok)
    prompts = [("s", " ".join(f"w{i}" for i in range(n))) for n in (2, 3, 260, 261, 40, 5)]
    out = tmp_path / "r.jsonl"
    n = generate_responses(engine, tok, prompts, out, max_new_tokens=4, max_prompt_tokens=400, batch_size=2,
                           progress=False)
    assert n == 6 and len(open(out).readlines()) == 6
    decode_keys = [k for k in engine.executables._table if k[0] == "decode"]
    assert len(decode_keys) == 1, decode_keys
