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


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BASTION_JAX_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("mode", ["dflash", "fixed:8", None])  # None: the default with a drafter, bastion
def test_speculative_modes_with_random_drafter_print_ar_text(capsys, tiny_ckpt, mode):
    common = ["w5 w6 w7 w8", "--target", tiny_ckpt, "--no-chat", "--max-new-tokens", "24"]
    rc, ar_text, ar_err = run(capsys, *common)
    assert rc == 0 and "[ar]" in ar_err and ar_text.strip()
    extra = ["--mode", mode] if mode else []
    rc, spec_text, spec_err = run(capsys, *common, "--drafter", "random", "--block-size", "4",
                                  "--buckets", "1,4,8", *extra)
    assert rc == 0, spec_err
    assert spec_text == ar_text
    assert f"[{mode or 'bastion'}]" in spec_err and "tau" in spec_err and "0 after" in spec_err
    if mode != "dflash":
        assert "buckets " in spec_err


def test_bastion_calibrates_once_and_compares_with_ar(capsys, tiny_ckpt):
    args = ["w5 w6 w7", "--target", tiny_ckpt, "--no-chat", "--max-new-tokens", "16", "--drafter", "random",
            "--block-size", "4", "--buckets", "1,4,8", "--compare-ar"]
    rc, out, err = run(capsys, *args)
    assert rc == 0, err
    assert "latency calibration: profiled" in err
    assert "[compare] bastion vs ar: speedup" in err and "text identical to AR: yes" in err
    rc, out2, err2 = run(capsys, *args)
    assert rc == 0 and "latency calibration: reused" in err2 and out2 == out


def test_fixed_mode_with_unknown_bucket_is_an_error(capsys, tiny_ckpt):
    rc, out, err = run(capsys, "w5", "--target", tiny_ckpt, "--drafter", "random", "--block-size", "4",
                       "--buckets", "1,4", "--mode", "fixed:8", "--quiet")
    assert rc == 2 and out == "" and err.startswith("error:") and "unknown bucket 8" in err


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
