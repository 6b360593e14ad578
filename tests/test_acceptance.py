"""The acceptance report's bookkeeping (bastion_jax.acceptance) on a scripted engine."""

import gzip
import json
from types import SimpleNamespace

import pytest

from bastion_jax.acceptance import PromptError, acceptance, markdown, read_prompts


class ScriptedEngine:
    """generate() returns fixed tokens and step counts per mode; 'bad' differs from AR on the 2nd row."""

    def generate(self, prompts, max_new_tokens, mode):
        tokens = [[len(p), 1, 2] for p in prompts]
        if mode == "bad":
            tokens[min(1, len(tokens) - 1)] = [99]
        steps = {"ar": 3, "good": 2, "bad": 1}[mode] * len(prompts)
        stats = SimpleNamespace(row_steps=steps, committed=3 * len(prompts), buckets={4: steps}, tau=0.0)
        return SimpleNamespace(tokens=tokens, stats=stats)


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
