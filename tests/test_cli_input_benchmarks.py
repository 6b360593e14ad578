"""Bad input to `benchmarks.run` and the --block-size of every CLI that has one: exit status 2 and one
`error: ...` line naming the problem, never a traceback, a late failure or a silently replaced value.

A flag that can be checked without the models is refused before they load: those cases pass a target
that does not exist, so a check made after loading would report the missing checkpoint instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bastion_jax.testing import one_error_line
from benchmarks import run

NOPE = "/nonexistent/bastion-target"


def _refused(capsys, main, argv: list[str], *fragments: str) -> str:
    """`main(argv)` refuses: status 2 (returned, or argparse's SystemExit), one error line."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    return one_error_line(capsys.readouterr().err, *fragments)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """{"hf": a tiny random HF Qwen3 with tokenizer, "prompts": a one-prompt JSONL file}."""
    from bastion_jax.testing import save_tiny_hf

    root = tmp_path_factory.mktemp("cli_input_bench")
    save_tiny_hf("qwen3", root / "hf", seed=4)
    (root / "p.jsonl").write_text(json.dumps({"question": "w5 w6 w7"}) + "\n")
    return {"hf": root / "hf", "prompts": root / "p.jsonl"}


# -- benchmarks.run: flags checked before anything loads --------------------------------------------

@pytest.mark.parametrize("argv,fragments", [
    (["--modes", "foo"], ("unknown mode 'foo'",)),
    (["--modes", "dflash,fixed:x"], ("fixed:N with an integer N",)),
    (["--modes", "fixed:7"], ("--modes fixed:7 needs bucket(s) 7", "now 1,4,8")),
    (["--modes", "bastion-paper"], ("bastion-paper needs a bucket of at least 32", "--buckets")),
    (["--modes", "bastion", "--fixed", "4"], ("--fixed 4", "with --modes")),
    (["--fixed", "4,16"], ("--fixed fixed:16 needs bucket(s) 16",)),
    (["--buckets", "abc"], ("bad --buckets 'abc'",)),
    (["--buckets", "0"], ("bad --buckets '0'", ">= 1")),
    (["--max-new-tokens", "0"], ("--max-new-tokens", "'0'")),
    (["--max-prompts", "0"], ("--max-prompts", "'0'")),
    (["--block-size", "0"], ("--block-size", ">= 2", "'0'")),
    (["--block-size", "1"], ("--block-size", ">= 2", "'1'")),
    (["--drafter", "/some/drafter", "--block-size", "8"], ("--block-size only applies to --drafter random",)),
])
def test_run_refuses_bad_flags_before_loading(capsys, argv, fragments):
    line = _refused(capsys, run.main, ["--target", NOPE, "--buckets", "1,4,8", *argv], *fragments)
    assert "not found" not in line  # refused before the (missing) target was looked for


def test_run_reports_a_missing_target_in_one_line(capsys, tiny):
    _refused(capsys, run.main, ["--target", NOPE, "--prompts", str(tiny["prompts"]), "--buckets", "1,4",
                                "--out-dir", "/nonexistent/out"], "checkpoint not found", NOPE)


def test_run_reports_a_missing_drafter_in_one_line(capsys, tiny, tmp_path):
    _refused(capsys, run.main, ["--target", str(tiny["hf"]), "--drafter", str(tmp_path / "nope"), "--prompts",
                                str(tiny["prompts"]), "--buckets", "1,4", "--out-dir", str(tmp_path)],
             "drafter checkpoint not found")


def test_run_reports_an_engine_refusal_in_one_line(capsys, tiny, tmp_path):
    _refused(capsys, run.main, ["--target", str(tiny["hf"]), "--drafter", "random", "--block-size", "4",
                                "--prompts", str(tiny["prompts"]), "--buckets", "1,4,100000", "--modes", "dflash",
                                "--out-dir", str(tmp_path)], "bucket 100000", "context of")
    assert not list(tmp_path.iterdir())  # nothing written


# -- --block-size: >= 2 at parse time, refused beside a loaded drafter -------------------------------

def _generate(argv):
    from bastion_jax.generate import main

    return main([*argv, "w1 w2"])


def _profile(argv):
    from bastion_jax.profile import main

    return main(argv)


def _perf_8b(argv):
    from benchmarks.perf_8b import main

    return main(argv)


@pytest.mark.parametrize("main", [_generate, _profile, _perf_8b, run.main])
@pytest.mark.parametrize("value", ["0", "1", "-4", "x"])
def test_block_size_below_two_is_refused_while_parsing(capsys, main, value):
    """0 used to become the default 16 (`args.block_size or 16`) without a word."""
    _refused(capsys, main, ["--target", NOPE, "--drafter", "random", f"--block-size={value}"],
             "--block-size", ">= 2", repr(value))


@pytest.mark.parametrize("main", [_generate, _profile, _perf_8b, run.main])
def test_block_size_with_a_loaded_drafter_is_refused(capsys, main, tmp_path):
    """A loaded drafter has its own block size: --block-size beside it would be ignored."""
    line = _refused(capsys, main, ["--target", NOPE, "--drafter", str(tmp_path), "--block-size", "8"],
                    "--block-size only applies to --drafter random")
    assert "not found" not in line


def test_profile_block_size_sizes_the_random_drafter(tiny):
    """The flag the refusals guard still works where it applies: --target with its random drafter."""
    from bastion_jax import profile

    args = profile.build_parser().parse_args(["--target", str(tiny["hf"]), "--block-size", "6", "--buckets", "1,4",
                                              "--contexts", "16", "--peaks", "datasheet"])
    assert profile.setup(args).engine.block_size == 6
