"""`python -m bastion_jax.train_drafter eval`: its buckets default to the device's (as generate's and
benchmarks.run's) plus each fixed:N of --modes, the report says which were compiled, and a mode that
cannot run is refused in one line before the drafter loads or bastion calibrates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bastion_jax.acceptance_cli import eval_buckets
from bastion_jax.controller import default_buckets
from bastion_jax.testing import one_error_line
from bastion_jax.train_drafter import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """{"hf": a tiny random HF Qwen3 with tokenizer, "drafter": a random block-4 drafter saved as a
    checkpoint, "prompts": a one-prompt JSONL file}."""
    from flax import nnx

    from bastion_jax.checkpoints import load_target, random_drafter, save_drafter
    from bastion_jax.presets import tiny_drafter_config
    from bastion_jax.testing import save_tiny_hf

    root = tmp_path_factory.mktemp("cli_input_eval")
    save_tiny_hf("qwen3", root / "hf", seed=4)
    target = load_target(root / "hf")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=4), target.dtype)
    (root / "drafter").mkdir()
    save_drafter(root / "drafter", drafter.config, nnx.to_pure_dict(drafter.state))
    (root / "p.jsonl").write_text(json.dumps({"question": "w5 w6 w7"}) + "\n")
    return {"hf": root / "hf", "drafter": root / "drafter", "prompts": root / "p.jsonl"}


def test_default_buckets_are_the_devices_plus_each_fixed_size():
    assert eval_buckets(["dflash", "bastion"], None) == default_buckets()
    assert eval_buckets(["dflash", "fixed:32", "bastion"], None) == tuple(sorted({*default_buckets(), 32}))
    assert eval_buckets(["fixed:4", "fixed:6"], None) == tuple(sorted({*default_buckets(), 4, 6}))
    assert eval_buckets(["fixed:4"], (1, 4, 8)) == (1, 4, 8)  # given: kept as it is


@pytest.mark.parametrize("argv,fragments", [
    (["--modes", "foo"], ("--modes", "unknown mode 'foo'", "eval --help")),
    (["--modes", "ar"], ("--modes", "no policy besides ar")),
    (["--buckets", "abc"], ("--buckets", "bad --buckets 'abc'")),
])
def test_bad_modes_and_buckets_are_refused_while_parsing(capsys, argv, fragments):
    """Refused before the target loads (it does not exist here)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["eval", "--target", "/nonexistent/target", *argv])
    assert e.value.code == 2
    one_error_line(capsys.readouterr().err, *fragments)


@pytest.mark.parametrize("argv,fragments", [
    (["--modes", "dflash,fixed:32", "--buckets", "1,4,8"], ("--modes fixed:32 needs bucket(s) 32", "now 1,4,8")),
    (["--modes", "bastion-paper"], ("bastion-paper needs a bucket of at least 32", "--buckets")),
])
def test_a_mode_its_buckets_cannot_run_is_refused_before_anything_loads(capsys, tiny, tmp_path, argv, fragments):
    """Neither the target nor the drafter exists: a check made after loading them (or after
    calibrating, as before) would report that instead."""
    capsys.readouterr()
    rc = main(["eval", "--target", str(tmp_path / "no-target"), "--drafter", str(tmp_path / "nope"), "--prompts",
               str(tiny["prompts"]), "--quiet", *argv])
    assert rc == 2
    line = one_error_line(capsys.readouterr().err, *fragments)  # (--quiet: no "loaded ..." progress line)
    assert "not found" not in line


def test_fixed_32_runs_on_cpu_without_buckets_and_the_report_names_them(capsys, tiny, tmp_path):
    rc = main(["eval", "--target", str(tiny["hf"]), "--drafter", str(tiny["drafter"]), "--prompts",
               str(tiny["prompts"]), "--modes", "fixed:32", "--max-prompts", "1", "--max-new-tokens", "4",
               "--batch-size", "1", "--tree-top-k", "8", "--lookup", "off", "--quiet", "--out", str(tmp_path / "acc")])
    assert rc == 0, capsys.readouterr().err
    compiled = tuple(sorted({*default_buckets(), 32}))
    report = json.loads((tmp_path / "acc.json").read_text())
    assert report["meta"]["buckets"] == list(compiled)
    assert report["tau"]["p"]["fixed:32"]["identical_to_ar"] is True
    words = ",".join(map(str, compiled)) + " compiled (this device's default plus 32 for fixed:32)"
    assert f"buckets {words}" in (tmp_path / "acc.md").read_text()
