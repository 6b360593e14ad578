"""`benchmarks.torch_originals`: its summary of the two sides' rows, and its refusals (one `error:` line).

The originals themselves (z-lab's and BASTION's code under transformers 4.57) are not installed here:
the benchmark's figures come from a run with them (benchmarks/results/cpu-smollm2-vs-torch-*.md).
"""

from __future__ import annotations

import json
import sys

import pytest

from bastion_jax.testing import one_error_line
from benchmarks import torch_originals


def rows(texts: dict[str, list[list[int]]], seconds: dict[str, float]) -> list[dict]:
    """Rows of two prompts (sets "a" and "b") per mode: `texts[mode][i]`, each step committing 2 tokens."""
    return [{"prompt": i, "source": "ab"[i], "mode": mode, "tokens": t, "seconds": seconds[mode],
             "ttft_s": 0.0, "steps": len(t) / 2, "committed": len(t)}
            for mode, ts in texts.items() for i, t in enumerate(ts)]


def test_summary_pools_tokens_over_seconds_and_counts_texts_equal_to_each_sides_ar(tmp_path):
    same, ours = [[1, 2, 3, 4], [5, 6]], [[1, 2, 3, 4], [5, 7]]  # (as if the libraries rounded apart on "b")
    texts = {"torch:ar": same, "torch:dflash": [[1, 2, 3, 9], [5, 6]], "ar": ours, "dflash": ours,
             "bastion": same}
    secs = {"torch:ar": 2.0, "torch:dflash": 4.0, "ar": 1.0, "dflash": 0.5, "bastion": 0.25}
    s = torch_originals.summarise(rows(texts, secs))
    assert list(s) == ["all", "a", "b"]
    assert list(s["all"]) == list(texts)  # the originals first, then ours, in the rows' order
    assert s["all"]["torch:ar"]["tokens_per_s"] == pytest.approx(6 / 4.0)
    assert s["all"]["bastion"]["ratio_to_torch_ar"] == pytest.approx((6 / 0.5) / (6 / 4.0))
    assert s["all"]["bastion"]["ratio_to_our_ar"] == pytest.approx(4.0)
    assert s["b"]["torch:dflash"]["tokens_per_s"] == pytest.approx(2 / 4.0)
    assert s["all"]["dflash"]["same_text_as_torch_ar"] == 1 and s["a"]["dflash"]["same_text_as_torch_ar"] == 1
    assert s["all"]["dflash"]["same_text_as_own_ar"] == 2  # ours is judged by our AR
    assert s["all"]["torch:dflash"]["same_text_as_own_ar"] == 1 and s["b"]["torch:dflash"]["same_text_as_own_ar"] == 1
    assert s["all"]["bastion"]["same_text_as_own_ar"] == 1 and s["all"]["bastion"]["same_text_as_torch_ar"] == 2
    assert s["all"]["bastion"]["answers"] == 2
    assert s["all"]["ar"]["tau"] == pytest.approx(2.0)
    record = {"meta": {"dtype": "float32", "device": "cpu", "cpu": "x", "date": "d", "commit": "c", "jax": "j",
                       "originals": "o", "torch": "t", "torch_threads": 2, "transformers": "4.57.1", "prompts": 2,
                       "sets": ["a", "b"], "max_new_tokens": 4, "reps": 1, "official_bastion": {}},
              "summary": s}
    md = torch_originals.markdown(record)
    assert "| dflash | 6.0 | 2.00 | 4.00 | 2.00 | 2/2 | 1/2 |" in md
    assert "torch:bastion" not in md
    # --report makes the summary and the table again from a saved run's rows
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"meta": record["meta"], "summary": {}, "rows": rows(texts, secs)}))
    assert torch_originals.main(["--report", str(saved)]) == 0
    assert json.loads(saved.read_text())["summary"] == json.loads(json.dumps(s))
    assert (tmp_path / "run.md").read_text() == md


def _refused(capsys, argv: list[str], *fragments: str) -> str:
    capsys.readouterr()
    try:
        rc = torch_originals.main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    return one_error_line(capsys.readouterr().err, *fragments)


def test_a_directory_without_the_originals_is_refused(capsys, tmp_path):
    _refused(capsys, ["--originals", str(tmp_path)], "--originals", "no dflash/model.py")
    _refused(capsys, [], "--originals is required")
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "model.py").write_text("")
    (tmp_path / "p.jsonl").write_text(json.dumps({"question": "Name a colour."}) + "\n")
    _refused(capsys, ["--originals", str(tmp_path), "--python", str(tmp_path / "nope" / "python"),
                      "--prompts", str(tmp_path / "p.jsonl")], "--python", "cannot run")
    (tmp_path / "x.json").write_text("{}")
    _refused(capsys, ["--report", str(tmp_path / "x.json")], "not a torch_originals run")


def test_an_interpreter_with_transformers_5_is_refused_in_one_line(capsys, tmp_path):
    """The originals call `DynamicCache.crop(start)`, which transformers 5 refuses (it takes a count
    to remove now): the torch side says which environment to point --python at, and the driver passes
    its line on as its own. (This environment's transformers is 5.x, its torch CPU.)"""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("this environment's transformers is < 5")
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "model.py").write_text("")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "Name a colour."}) + "\n")
    _refused(capsys, ["--originals", str(tmp_path), "--python", sys.executable, "--prompts", str(prompts),
                      "--max-prompts", "1", "--max-new-tokens", "4", "--out-dir", str(tmp_path / "out")],
             "transformers < 5", "--python")
    assert not (tmp_path / "out").exists()
