"""The acceptance report's bookkeeping (bastion_jax.acceptance) on a scripted engine."""

import gzip
import json

import numpy as np
import pytest

from bastion_jax.acceptance import PromptError, acceptance, markdown, read_prompts


class ScriptedEngine:
    """stream() yields fixed tokens in fixed steps per mode ("ar" one token a step, "good" the whole text
    in 2 steps, "bad" in 1 step); "bad" differs from AR on the 2nd row."""

    def stream(self, prompts, max_new_tokens, mode, stats):
        tokens = [[len(p), 1, 2] for p in prompts]
        if mode == "bad":
            tokens[min(1, len(tokens) - 1)] = [99]
        cuts = {"ar": [1, 2, 3], "good": [2, 3], "bad": [3]}[mode]
        stats.row_steps += len(cuts) * len(prompts)
        stats.committed += 3 * len(prompts)
        stats.buckets[4] = stats.buckets.get(4, 0) + len(cuts) * len(prompts)
        start = 0
        for cut in cuts:
            yield [t[start:cut] for t in tokens]
            start = cut


def test_tau_pools_steps_and_identity_is_checked_per_batch():
    sets = {"a": [[1], [2, 2], [3, 3, 3]], "b": [[4]]}
    report = acceptance(ScriptedEngine(), sets, ["good", "bad"], max_new_tokens=3, batch_size=2)
    assert report["a"]["good"] == {"steps": 6, "committed": 9, "identical_to_ar": True, "buckets": {"4": 6},
                                   "tau": 1.5}
    assert report["a"]["bad"]["tau"] == 3.0 and report["a"]["bad"]["identical_to_ar"] is False
    assert report["b"]["bad"]["identical_to_ar"] is False  # a batch of one: its only row differs
    lines = markdown(report, ["good", "bad"])
    assert "| a | 1.50 | 3.00 |" in lines and "| all | 1.50 | 3.00 |" in lines
    assert lines[-1].endswith("NO.")


def test_steps_ending_on_rare_tokens_are_counted_from_each_steps_last_token():
    """AR texts [1, 1, 2] and [2, 1, 2]: "good" ends its steps on 1 and 2 in both rows, "bad" on 2
    (row 1) and 99 (row 2: [99]). With 1 and 99 rare, each ends on a rare token in half its steps,
    and 1 is half of the AR text."""
    rare = np.zeros(100, bool)
    rare[[1, 99]] = True
    sets = {"a": [[5], [6, 6]]}
    report = acceptance(ScriptedEngine(), sets, ["good", "bad"], max_new_tokens=3, batch_size=2, rare=rare)
    assert report["a"]["good"]["ended_rare"] == 2 and report["a"]["good"]["steps"] == 4
    assert report["a"]["bad"]["ended_rare"] == 1  # row 1 ends on 2, row 2 on 99
    assert report["a"]["good"]["rare_share"] == pytest.approx(3 / 6)
    lines = markdown(report, ["good", "bad"], rare_top=98)
    assert "top 98 ranked tokens" in lines[-1] and "good 50.0%, bad 50.0%" in lines[-1]
    assert "a 50.0% of the AR text" in lines[-1]


def test_read_prompts_takes_first_turns_and_refuses_bad_files(tmp_path):
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"turns": ["first", "second"]}) + "\n\n" + json.dumps({"problem": "p2"}) + "\n"
                + json.dumps({"instruction": "do", "input": "this"}) + "\n")
    assert read_prompts(path, 10) == ["first", "p2", "do\n\nthis"]
    assert read_prompts(path, 1) == ["first"]
    (tmp_path / "empty.jsonl").write_text(json.dumps({"answer": 1}) + "\n")
    with pytest.raises(PromptError, match="no prompt"):
        read_prompts(tmp_path / "empty.jsonl", 5)
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(PromptError, match="cannot read"):
        read_prompts(tmp_path / "broken.jsonl", 5)
