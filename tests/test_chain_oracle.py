"""benchmarks.chain_oracle: its per-position table against chains found one position at a time."""

import jax.numpy as jnp
import numpy as np

from bastion_jax.datastore import NUM_CLASSES, load_datastore, save_datastore, store_chain
from bastion_jax.lookup import LookupConfig, find_chain
from bastion_jax.testing import one_error_line
from benchmarks.chain_oracle import answer_table, main, runs


def test_runs_count_leading_matches():
    chain = np.array([[5, 6, 7], [5, 9, 7], [-1, -1, -1], [3, 4, -1]])
    truth = np.array([[5, 6, 8], [5, 6, 7], [-1, 2, 2], [3, 4, 1]])
    assert runs(chain, truth).tolist() == [2, 1, 0, 2]  # -1 never counts, even against -1


def test_answer_table_matches_one_position_at_a_time(tmp_path):
    rng = np.random.default_rng(0)
    vocab = 12
    corpus = [rng.integers(0, vocab, 40).tolist() for _ in range(6)]
    path = tmp_path / "ds.npz"
    save_datastore(path, corpus, np.linspace(0.1, 0.9, NUM_CLASSES), np.full(NUM_CLASSES, 0.6), vocab, {})
    store = load_datastore(path, vocab, cache=False)
    cfg = LookupConfig()
    prompt = corpus[0][:10]
    answer = corpus[0][10:25] + prompt[:6] + rng.integers(0, vocab, 8).tolist()  # copies from both sources
    depth = 5
    table = answer_table(cfg, store, prompt, answer, depth)
    text = np.asarray(prompt + answer, np.int32)
    assert table.shape == (len(answer) - 1, 4)
    for i in range(len(answer) - 1):
        root = len(prompt) + i
        hist = jnp.asarray(np.where(np.arange(len(text)) <= root, text, 0))
        truth = answer[i + 1:i + 1 + depth]
        expect = []
        for chain in (np.asarray(find_chain(cfg, hist, jnp.int32(root), depth).tokens),
                      np.asarray(store_chain(store, hist, jnp.int32(root), depth)[0])):
            n = 0
            while n < len(truth) and chain[n] >= 0 and chain[n] == truth[n]:
                n += 1
            expect.append(n)
        assert table[i, :2].tolist() == expect, i
        assert table[i, 2] in expect and table[i, 3] == max(expect)
    assert (table[:, 0] > 0).any() and (table[:, 1] > 0).any()  # both sources matter in this answer


def test_a_missing_prompt_file_is_one_error_line(tmp_path, capsys):
    assert main(["--prompts", str(tmp_path / "none.jsonl"), "--out-dir", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, "none.jsonl")
