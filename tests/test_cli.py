"""The generate CLI end to end on a tiny converted model: modes, batches, stdout/stderr split."""

import json

import pytest

from bastion_jax import generate
from bastion_jax.testing import save_tiny_hf
from checkpoints_convert import convert


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    save_tiny_hf("llama3", root / "hf", seed=2)
    convert(root / "hf", root / "ckpt", dtype="float32")
    return str(root / "ckpt")


def run(capsys, *argv):
    rc = generate.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_dflash_with_random_drafter_prints_ar_text(capsys, tiny_ckpt):
    common = ["w5 w6 w7 w8", "--target", tiny_ckpt, "--no-chat", "--max-new-tokens", "24"]
    rc, ar_text, ar_err = run(capsys, *common)
    assert rc == 0 and "[ar]" in ar_err and ar_text.strip()
    rc, spec_text, spec_err = run(capsys, *common, "--drafter", "random", "--block-size", "4")
    assert rc == 0, spec_err
    assert spec_text == ar_text
    assert "[dflash]" in spec_err and "tau" in spec_err


def test_batch_prints_json_lines(capsys, tiny_ckpt):
    rc, out, err = run(capsys, "w5 w6", "w9 w10 w11 w12 w13", "--target", tiny_ckpt, "--no-chat",
                       "--max-new-tokens", "6", "--quiet")
    assert rc == 0 and err == ""
    lines = [json.loads(line) for line in out.splitlines()]
    assert [x["prompt"] for x in lines] == ["w5 w6", "w9 w10 w11 w12 w13"]
    assert all(isinstance(x["completion"], str) for x in lines)


def test_mode_dflash_without_drafter_is_an_error(capsys, tiny_ckpt):
    rc, out, err = run(capsys, "w5", "--target", tiny_ckpt, "--mode", "dflash", "--quiet")
    assert rc == 2 and out == "" and err.startswith("error:") and "--drafter" in err


def test_missing_drafter_dir_is_an_error(capsys, tiny_ckpt, tmp_path):
    rc, out, err = run(capsys, "w5", "--target", tiny_ckpt, "--drafter", str(tmp_path / "nope"), "--quiet")
    assert rc == 2 and err.count("\n") == 1 and "drafter" in err
