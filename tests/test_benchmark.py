"""The benchmark harness end to end on a tiny model and a tiny prompt file (CPU)."""

import gzip
import json

from benchmarks import run
from bastion_jax.testing import save_tiny_hf
from bastion_jax.checkpoints import convert


def test_harness_writes_results_and_all_modes_match_ar(tmp_path):
    save_tiny_hf("qwen3", tmp_path / "hf", seed=4)
    convert(tmp_path / "hf", tmp_path / "ckpt", dtype="float32")
    prompts = tmp_path / "p.jsonl.gz"
    with gzip.open(prompts, "wt") as f:
        f.write(json.dumps({"question": "w5 w6 w7"}) + "\n" + json.dumps({"turns": ["w9 w10", "w11"]}) + "\n")
    rc = run.main(["--prompts", str(prompts), "--target", str(tmp_path / "ckpt"), "--block-size", "4",
                   "--buckets", "1,4,8", "--fixed", "4,8", "--max-new-tokens", "12", "--reps", "2", "--name", "tiny",
                   "--out-dir", str(tmp_path / "out"), "--dtype", "float32"])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "tiny.json").read_text())
    assert set(data["overall"]) == {"ar", "dflash", "fixed:4", "fixed:8", "bastion"}
    assert data["meta"]["prompts"] == 2 and data["meta"]["device"] and data["meta"]["reps"] == 2
    prices = data["meta"]["calibrated_step_ms_at_256"]  # the fit this run's choices were made on
    assert {"ar", "ar+draft", "4", "8"} <= set(prices) and all(v > 0 for v in prices.values())
    assert all(r["identical_to_ar"] for r in data["rows"])
    assert all(r["compilations_after_warmup"] == 0 for r in data["rows"])
    assert data["overall"]["ar"]["ratio_to_ar"] == 1.0
    assert data["overall"]["ar"]["decode_ratio_to_ar"] == 1.0
    for mode, o in data["overall"].items():  # decoding alone: the tokens after each prompt's first, after its prefill
        mine = [r for r in data["rows"] if r["mode"] == mode]
        decode = sum(r["new_tokens"] - 1 for r in mine) / sum(r["decode_s"] for r in mine)
        assert abs(o["decode_tokens_per_s"] - decode) < 1e-6 * decode
        assert abs(o["ttft_ms"] - 1e3 * sum(r["ttft_s"] for r in mine) / len(mine)) < 1e-6 * o["ttft_ms"]
    table = (tmp_path / "out" / "tiny.md").read_text()
    assert "| bastion |" in table and "NO" not in table and "| decode ratio to AR |" in table
    assert set(data["tau_by_source"]) == {"p"} and set(data["tau_by_source"]["p"]) == set(data["overall"])
    assert data["tau_by_source"]["p"]["ar"] == 1.0 and "tau by prompt set" in table
    assert "best fixed in hindsight" in table and "*" in table.split("best fixed")[1]
    csv_rows = (tmp_path / "out" / "tiny.csv").read_text().splitlines()
    assert csv_rows[0] == "set,mode,tokens_per_s,tau,ratio_to_ar" and len(csv_rows) == 1 + 5
    assert (tmp_path / "out" / "tiny.png").stat().st_size > 1000 and data["meta"]["commit"]


def test_median_run_keeps_the_run_of_median_time():
    from types import SimpleNamespace

    def result(ttft, decode, tag):
        return SimpleNamespace(stats=SimpleNamespace(ttft_s=ttft, decode_s=decode), tag=tag)

    runs = [result(0.1, 2.9, "slow"), result(0.1, 0.9, "fast"), result(0.2, 1.8, "median")]
    assert run.median_run(runs).tag == "median"
    assert run.median_run(runs[:2]).tag == "fast"  # an even count keeps the faster middle run
    assert run.median_run(runs[:1]).tag == "slow"


def test_results_name_a_dirty_checkout(monkeypatch):
    """A run from uncommitted changes (a device call carries the working tree) must not pass for the
    commit before them."""
    import subprocess
    from types import SimpleNamespace

    from benchmarks import report

    def fake(status: str):
        def run(args, **kw):
            out = "abc1234\n" if "rev-parse" in args else status
            return SimpleNamespace(stdout=out)
        return run

    monkeypatch.setattr(subprocess, "run", fake(""))
    assert report.commit() == "abc1234"
    monkeypatch.setattr(subprocess, "run", fake(" M bastion_jax/modeling/prefix_kernel.py\n"))
    assert report.commit() == "abc1234+dirty"


def test_harness_samples_at_temperature(tmp_path, monkeypatch):
    """At T > 0 every mode runs the sampling steps (calibrated and warmed for them: nothing compiles
    while timed), answers are not compared, and the report says how it sampled."""
    from bastion_jax.engine import Engine

    asked, real = [], Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, *a, **k: (asked.append((k["sampling"], k["seed"])),
                                                                    real(self, *a, **k))[1])
    save_tiny_hf("qwen3", tmp_path / "hf", seed=4)
    convert(tmp_path / "hf", tmp_path / "ckpt", dtype="float32")
    prompts = tmp_path / "p.jsonl.gz"
    with gzip.open(prompts, "wt") as f:
        f.write(json.dumps({"question": "w5 w6 w7"}) + "\n")
    rc = run.main(["--prompts", str(prompts), "--target", str(tmp_path / "ckpt"), "--block-size", "4",
                   "--buckets", "1,4", "--modes", "bastion", "--max-new-tokens", "12", "--reps", "2",
                   "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--name", "hot",
                   "--out-dir", str(tmp_path / "out"), "--dtype", "float32"])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "hot.json").read_text())
    assert data["meta"]["sampling"] == {"temperature": 0.8, "top_k": 0, "top_p": 0.9, "seed": 3}
    assert all(r["identical_to_ar"] is None for r in data["rows"])
    assert all(r["compilations_after_warmup"] == 0 for r in data["rows"])
    assert data["overall"]["bastion"]["all_identical_to_ar"] is None
    table = (tmp_path / "out" / "hot.md").read_text()
    assert "T=0.8, top-p 0.9" in table and "| n/a |" in table and "NO" not in table
    assert asked and all(s.temperature == 0.8 and s.top_p == 0.9 for s, _ in asked)  # warm-up and timed runs
    assert {seed for _, seed in asked} == {3}  # one request (prompt 0): seed + 0


def test_harness_times_batches(tmp_path, capsys):
    """--batch N: consecutive prompts go out as one request, every mode's rows equal AR's at T=0, one
    result row per batch and mode; a prompt count that is not a multiple of N is one error line."""
    import pytest

    save_tiny_hf("qwen3", tmp_path / "hf", seed=4)
    convert(tmp_path / "hf", tmp_path / "ckpt", dtype="float32")
    prompts = tmp_path / "p.jsonl.gz"
    with gzip.open(prompts, "wt") as f:
        f.write(json.dumps({"question": "w5 w6 w7"}) + "\n" + json.dumps({"question": "w9 w10 w11 w12 w13"}) + "\n")
    common = ["--prompts", str(prompts), "--target", str(tmp_path / "ckpt"), "--block-size", "4", "--buckets", "1,4",
              "--modes", "fixed:4,bastion", "--max-new-tokens", "10", "--out-dir", str(tmp_path / "out"),
              "--dtype", "float32"]
    assert run.main(common + ["--batch", "2", "--name", "b2"]) == 0
    data = json.loads((tmp_path / "out" / "b2.json").read_text())
    assert data["meta"]["batch"] == 2 and len(data["rows"]) == 3  # ar, fixed:4, bastion: one batch each
    assert all(r["identical_to_ar"] for r in data["rows"])
    assert all(r["compilations_after_warmup"] == 0 for r in data["rows"])
    ar = next(r for r in data["rows"] if r["mode"] == "ar")
    assert ar["new_tokens"] == 20 and ar["prompt"].endswith("(+1 more)")
    assert "batches of 2 prompts" in (tmp_path / "out" / "b2.md").read_text()
    with pytest.raises(SystemExit, match="--batch 3 needs a multiple of 3 prompts, got 2"):
        run.main(common + ["--batch", "3", "--name", "b3"])


def test_a_fixed_size_that_is_no_bucket_is_refused_in_one_line(tmp_path, capsys):
    """The fixed sweep never widens bastion's trees behind the user's back: the largest bucket prices
    every draft, so a sweep size outside the buckets is an error naming what to add."""
    import pytest

    save_tiny_hf("qwen3", tmp_path / "hf", seed=4)
    convert(tmp_path / "hf", tmp_path / "ckpt", dtype="float32")
    with pytest.raises(SystemExit) as e:
        run.main(["--target", str(tmp_path / "ckpt"), "--block-size", "4", "--buckets", "1,4,8", "--fixed", "4,16",
                  "--out-dir", str(tmp_path / "out"), "--dtype", "float32"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--fixed fixed:16 needs bucket(s) 16" in err and "now 1,4,8" in err
