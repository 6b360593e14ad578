"""The generate CLI end to end on a tiny converted model: modes, batches, stdout/stderr split."""

import json
import re
from pathlib import Path

import pytest

from bastion_jax import calibration, generate, warmup
from bastion_jax.testing import save_tiny_hf
from bastion_jax.checkpoints import convert


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    save_tiny_hf("llama3", root / "hf", seed=2)
    convert(root / "hf", root / "ckpt", dtype="float32")
    return str(root / "ckpt")


# A run's summary when its warm-up compiled nothing and nothing compiled after it (the seconds are
# the untimed first runs: wall time, not checked)
NOTHING_COMPILED = re.compile(r"warm-up \d+\.\ds \(0 compiled, 0 after\)")


# The calibration's progress bar (tqdm on stderr) as it starts: every step's first run and each round to go.
CALIBRATION_BAR = re.compile(r"latency calibration: +0%\|.*\| 0/\d+ ")
WARMUP_BAR = re.compile(r"warm-up: +\d+%\|.*\| \d+/\d+ ")


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


RANDOM_PAIR = ["--drafter", "random", "--block-size", "4", "--buckets", "1,4"]


def test_only_a_run_that_profiled_writes_the_calibration(capsys, tiny_ckpt, tmp_path, monkeypatch):
    """--no-calibrate never writes a calibration (runs used to save their online-corrected model, which
    the next run then reused as if it were measured); a batch profiles and saves at its own size,
    which never prices one row: the next single-prompt run profiles afresh, saves, and the one after
    reuses it, as does the next batch of that size. The last single run also compares with AR at
    temperature 0."""
    single = ["w5 w6 w7", "--target", tiny_ckpt, "--no-chat", "--max-new-tokens", "16", *RANDOM_PAIR]
    batch = ["w5 w6", "w7 w8 w9 w10", "--target", tiny_ckpt, "--no-chat", "--max-new-tokens", "8", *RANDOM_PAIR]
    calibration = tmp_path / "cache" / "calibration"
    monkeypatch.setattr(warmup, "BAR_DELAY_S", 0)  # (a tiny model's warm-up may end before the bar's delay)
    rc, _, err = run(capsys, *single, "--no-calibrate")
    assert rc == 0 and "latency calibration: skipped" in err, err
    assert not calibration.exists() or not any(calibration.iterdir())
    rc, _, err = run(capsys, *batch)
    assert rc == 0 and "latency calibration: profiled" in err and "at batch 2" in err, err
    assert len(list(calibration.iterdir())) == 1
    rc, out, err = run(capsys, *single)
    assert rc == 0 and "latency calibration: profiled" in err and "at batch" not in err, err
    # What profiling costs is said first, then a bar counts it out (minutes of silence on a fresh machine).
    assert "latency calibration: none saved for this setting yet: compiling" in err and CALIBRATION_BAR.search(err)
    saved = [f for f in calibration.iterdir() if '"batch": 1' in f.read_text()]
    assert len(saved) == 1 and len(list(calibration.iterdir())) == 2
    written = saved[0].read_text()
    rc, out2, err2 = run(capsys, *single, "--compare-ar")
    assert rc == 0 and "latency calibration: reused" in err2 and out2 == out, err2
    assert not CALIBRATION_BAR.search(err2) and "none saved" not in err2
    assert WARMUP_BAR.search(err2)  # (the steps' first runs, before anything is timed)
    assert saved[0].read_text() == written  # generating (online corrections) did not rewrite it
    assert "[compare] bastion vs ar: speedup" in err2 and "text identical to AR: yes" in err2
    # Both timed runs were warmed up alike: neither compiled anything while being timed.
    assert "[compare] warm-up: bastion and ar" in err2
    assert len(NOTHING_COMPILED.findall(err2)) == 2, err2
    rc, _, err = run(capsys, *batch)
    assert rc == 0 and "latency calibration: reused" in err, err
    rc, _, err = run(capsys, *batch, "--quiet")  # (a new engine: it warms up again, silently)
    assert rc == 0 and err == "", err
    # --recalibrate profiles although one is saved, and saves over it (a busy machine's prices).
    rc, out3, err = run(capsys, *single, "--recalibrate", "--quiet")
    assert rc == 0 and "latency calibration" not in err and out3 == out, err  # (--quiet: no bar either)
    assert len(list(calibration.iterdir())) == 2 and saved[0].read_text() != written
    rc, _, err = run(capsys, *single, "--recalibrate", "--no-calibrate")
    assert rc != 0 and err.strip().splitlines() == ["error: --recalibrate profiles and --no-calibrate does not: "
                                                    "give one of them"], err


def test_calibration_key_follows_the_setting_not_the_spelling(tiny_ckpt, tmp_path, monkeypatch):
    """The key changes with tree width, buckets, dtype and the model's files, and not with how the
    target's path is written (relative, absolute, through a symlink)."""
    import os
    import shutil

    import jax.numpy as jnp

    from bastion_jax.checkpoints import load_target, random_drafter
    from bastion_jax.engine import Engine
    from bastion_jax.testing import tiny_drafter_config

    def path_for(target_path, dtype=jnp.float32, buckets=(1, 4), top_k=8, lookup=True):
        target = load_target(target_path, dtype)
        drafter = random_drafter(tiny_drafter_config(target.config, block_size=4), target.dtype)
        engine = Engine(target, stop_ids=[-1], drafter=drafter, buckets=buckets, top_k=top_k)
        return calibration.calibration_path(engine, calibration.calibration_model(target, drafter, lookup=lookup))

    copy = Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))
    (tmp_path / "link").symlink_to(copy)
    monkeypatch.chdir(tmp_path)
    base = path_for(copy)
    assert path_for("ckpt") == path_for("./link/") == base
    assert path_for(copy, top_k=16) != base
    assert path_for(copy, lookup=False) != base
    assert path_for(copy, buckets=(1, 4, 8)) != base
    assert path_for(copy, dtype=jnp.bfloat16) != base
    config = copy / "config.json"
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the checkpoint was rewritten
    assert path_for(copy) != base


def test_compare_ar_at_temperature_does_not_claim_identity(capsys, tiny_ckpt):
    """At T > 0 the two runs draw their own samples: no identical/differs verdict; both warmed up."""
    rc, out, err = run(capsys, "w5 w6 w7", "--target", tiny_ckpt, "--no-chat", "--max-new-tokens", "8",
                       *RANDOM_PAIR, "--mode", "fixed:4", "--compare-ar", "--temperature", "0.9", "--seed", "3")
    assert rc == 0, err
    line = next(x for x in err.splitlines() if x.startswith("[compare] fixed:4 vs ar"))
    assert "texts not compared (temperature 0.9" in line
    assert "identical" not in line and "differs" not in line
    assert len(NOTHING_COMPILED.findall(err)) == 2, err


def test_top_k_is_the_sampling_top_k(capsys, tiny_ckpt):
    """--top-k 1 at temperature 1 samples only the most likely token: the greedy text. (When --top-k was
    the tree width this sampled the whole distribution.) --tree-top-k is the tree width."""
    args = generate.build_parser().parse_args(["x", "--top-k", "3", "--tree-top-k", "5"])
    assert (args.top_k, args.tree_top_k) == (3, 5)
    assert generate.build_parser().parse_args(["x", "--sample-top-k", "2"]).top_k == 2  # old spelling, hidden
    assert generate.build_parser().parse_args(["x"]).top_k == 0
    common = ["w5 w6 w7", "--target", tiny_ckpt, "--no-chat", "--max-new-tokens", "12", "--quiet"]
    rc, greedy, _ = run(capsys, *common)
    rc2, sampled, err = run(capsys, *common, "--temperature", "1.0", "--top-k", "1", "--seed", "4")
    assert rc == rc2 == 0, err
    assert sampled == greedy
    rc, unrestricted, _ = run(capsys, *common, "--temperature", "1.0", "--seed", "4")
    assert unrestricted != greedy  # the control: without --top-k 1 this seed does not give the greedy text


def test_loaded_lines_say_which_dtype_is_used(capsys, tiny_ckpt):
    rc, _, err = run(capsys, "w5", "--target", tiny_ckpt, "--no-chat", "--max-new-tokens", "2", "--drafter",
                     "random", "--mode", "dflash")
    assert rc == 0 and "float32: the checkpoint's dtype" in err and "float32 like the target" in err, err
    rc, _, err = run(capsys, "w5", "--target", tiny_ckpt, "--no-chat", "--max-new-tokens", "2", "--dtype", "bfloat16")
    assert rc == 0 and "bfloat16: --dtype" in err, err
    assert "ended: max new tokens" in err
    assert "slower than float32" not in err  # bf16 runs on XLA:CPU's bf16 kernels (tests/test_cpu_bf16.py)


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


def test_the_cli_keeps_compiled_steps_in_the_cache_root(tiny_ckpt, tmp_path):
    """generate keeps its executables in <cache root>/xla (JAX's persistent compilation cache), so a
    second run loads its warm-up instead of compiling it; a JAX_COMPILATION_CACHE_DIR the user set wins.
    Run in fresh processes: JAX reads the cache settings once per process."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(BASTION_JAX_CACHE=str(tmp_path / "root"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    cmd = [sys.executable, "-m", "bastion_jax.generate", "w5 w6 w7", "--target", tiny_ckpt, "--no-chat",
           "--max-new-tokens", "4"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    entries = sorted(p.name for p in (tmp_path / "root" / "xla").iterdir())
    assert any(n.startswith("jit_decode-") for n in entries), entries
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert sorted(p.name for p in (tmp_path / "root" / "xla").iterdir()) == entries  # loaded, not compiled anew
    own = dict(env, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "mine"))
    assert subprocess.run(cmd, env=own, capture_output=True, text=True, timeout=600).returncode == 0
    assert any(p.name.startswith("jit_decode-") for p in (tmp_path / "mine").iterdir())


@pytest.mark.parametrize("bad, message", [(("--max-new-tokens", "0"), "--max-new-tokens: expected a whole number >= 1"),
                                          (("--mode", "weird"), "unknown mode 'weird'"),
                                          (("--temperature", "-1"), "temperature must be"),
                                          (("--cond-depths", "x"), "--cond-depths: must be auto or a number"),
                                          (("--cond-depths", "-2"), "--cond-depths: must be auto or a number"),
                                          (("--cond-candidates", "-1"), "--cond-candidates: must be auto or a number")])
def test_bad_settings_are_refused_before_loading(capsys, tmp_path, bad, message):
    """A bad setting is named before any checkpoint is read (here none exists), not after loading
    and calibrating (argparse refuses a bad count while parsing: exit status 2)."""
    try:
        rc, _, err = run(capsys, "w5", "--target", str(tmp_path / "missing"), *bad)
    except SystemExit as e:
        rc, err = e.code, capsys.readouterr().err
    assert rc != 0 and message in err and "missing" not in err


def test_the_default_pair_runs_in_bf16_on_a_cpu_with_bf16_units(monkeypatch):
    """--dtype auto keeps a named checkpoint's own dtype, and runs the embedded default pair in bf16
    where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX flags), float32 elsewhere."""
    import jax
    import jax.numpy as jnp

    from bastion_jax import cli, hardware

    first = {"processor": "0", "flags": "fpu sse2 avx2 avx512f avx512_bf16 amx_tile"}  # (hardware._cpuinfo's form)
    for info, units in ((first, True), ({"flags": "fpu sse2 avx2 avx512f avx512bw"}, False), ({}, False)):
        monkeypatch.setattr(hardware, "_cpuinfo", lambda info=info: info)
        assert hardware.cpu_has_bf16_units() == units
        on_cpu = jax.default_backend() == "cpu"
        assert cli.resolve_dtype("auto", default_pair=True) == (jnp.bfloat16 if units and on_cpu else None)
        assert cli.resolve_dtype("auto") is None  # a checkpoint the user names keeps its dtype
        assert cli.resolve_dtype("float32", default_pair=True) == jnp.float32  # asked for: as asked
    assert "bf16 units" in cli.dtype_note("auto", jnp.dtype(jnp.bfloat16))
    assert cli.dtype_note("auto") == "the checkpoint's dtype" and cli.dtype_note("bfloat16") == "--dtype"
