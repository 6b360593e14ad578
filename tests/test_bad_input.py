"""Bad input to the two CLIs ends in exit status 2 and one `error: ...` line naming the problem.

`python -m checkpoints_convert SRC OUT` and `python -m bastion_jax.generate` are called through
their `main(argv)`; stderr must be exactly one line (no traceback) that says what is wrong.
Checkpoints are tiny random HF Llamas built in-process (no downloads).
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from bastion_jax import generate
from bastion_jax.testing import one_error_line
from checkpoints_convert.__main__ import main as convert_main

_WORDS = [f"w{i}" for i in range(40)]


def _save_tiny_tokenizer(directory: Path) -> None:
    """A whitespace word-level tokenizer over 42 tokens (fits vocab_size=128), saved HF-style."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *_WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(directory))


def _save_tiny_hf(directory: Path) -> None:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(directory))
    _save_tiny_tokenizer(directory)


@pytest.fixture(scope="module")
def _tiny(tmp_path_factory) -> dict[str, Path]:
    """{"hf": tiny HF checkpoint dir (with tokenizer), "ours": the same converted to float32}."""
    from bastion_jax.checkpoints import convert

    root = tmp_path_factory.mktemp("tiny_bad_input")
    _save_tiny_hf(root / "hf")
    convert(root / "hf", root / "ours", dtype="float32")
    return {"hf": root / "hf", "ours": root / "ours"}


@pytest.fixture
def _hf_copy(_tiny, tmp_path) -> Path:
    """A private copy of the tiny HF checkpoint that a test may damage."""
    return Path(shutil.copytree(_tiny["hf"], tmp_path / "src"))


def _convert(capsys, src: Path, out: Path, *fragments: str) -> str:
    """Run the converter CLI, expect failure: status 2, one error line, no output directory made."""
    existed = out.exists()
    capsys.readouterr()  # drop anything the fixtures printed
    rc = convert_main([str(src), str(out)])
    cap = capsys.readouterr()
    assert rc == 2, cap.err
    assert cap.out == ""
    if not existed:
        assert not out.exists(), "a failed conversion must not leave an output directory"
    return one_error_line(cap.err, *fragments)


def _rewrite_safetensors(directory: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    f = directory / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


# -- python -m checkpoints_convert ---------------------------------------------------------------

def test_convert_reference_case_succeeds(capsys, _tiny, tmp_path):
    """The untouched tiny checkpoint converts (so every failure below is caused by its damage)."""
    capsys.readouterr()
    assert convert_main([str(_tiny["hf"]), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "config.json").is_file()
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_convert_nonexistent_path(capsys, tmp_path):
    _convert(capsys, tmp_path / "nope", tmp_path / "out", "not found", "nope")


def test_convert_dir_without_config(capsys, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.safetensors").write_bytes(b"")
    _convert(capsys, tmp_path / "src", tmp_path / "out", "config.json")


def test_convert_unknown_model_type(capsys, _hf_copy, tmp_path):
    cfg = json.loads((_hf_copy / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (_hf_copy / "config.json").write_text(json.dumps(cfg))
    _convert(capsys, _hf_copy, tmp_path / "out", "model_type", "gpt2", "llama")


def test_convert_corrupt_config(capsys, _hf_copy, tmp_path):
    (_hf_copy / "config.json").write_text('{"model_type": "llama", ')
    _convert(capsys, _hf_copy, tmp_path / "out", "config.json")


@pytest.mark.parametrize("garbage", [b"\x01\x02garbage bytes, not a safetensors header" * 8, b""],
                         ids=["garbage", "empty"])
def test_convert_garbage_safetensors(capsys, _hf_copy, tmp_path, garbage):
    (_hf_copy / "model.safetensors").write_bytes(garbage)
    _convert(capsys, _hf_copy, tmp_path / "out", "safetensors", "model.safetensors")


def test_convert_missing_tensor(capsys, _hf_copy, tmp_path):
    _rewrite_safetensors(_hf_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    _convert(capsys, _hf_copy, tmp_path / "out", "missing tensor", "layers.1.mlp.up_proj.weight")


def test_convert_wrong_shape(capsys, _hf_copy, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 32), np.float32)  # needs (16, 32)

    _rewrite_safetensors(_hf_copy, edit)
    _convert(capsys, _hf_copy, tmp_path / "out", "shape", "layers.0.self_attn.k_proj.weight",
             "(16, 32)", "(32, 32)")


def test_convert_nonempty_output_dir(capsys, _tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    _convert(capsys, _tiny["hf"], out, "not empty", str(out))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]  # nothing written, nothing removed
    assert (out / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("garbage", [b"this is not a GGUF file at all" * 20, b"GGUF" + bytes(range(256)) * 4],
                         ids=["no-magic", "bad-header"])
def test_convert_garbage_gguf(capsys, tmp_path, garbage):
    (tmp_path / "model.gguf").write_bytes(garbage)
    _convert(capsys, tmp_path / "model.gguf", tmp_path / "out", "GGUF", "model.gguf")


# Malformed configs and an output path that is a file: each is refused with one line naming the problem
# (these once escaped as tracebacks).
@pytest.mark.parametrize("case,fragments", [
    ("config-not-object", ("config.json", "expected a JSON object")),
    ("config-field-not-int", ("malformed config.json field", "'big'")),
    ("zero-heads", ("num_attention_heads", "must be positive", "got 0")),  # was a ZeroDivisionError
    ("generation-config-not-object", ("generation_config.json", "expected a JSON object")),
    ("output-is-a-file", ("exists and is not a directory",)),
])
def test_convert_malformed_config_or_output_path_isone_error_line(capsys, _hf_copy, tmp_path, case, fragments):
    out = tmp_path / "out"
    cfg = json.loads((_hf_copy / "config.json").read_text())
    if case == "config-not-object":
        (_hf_copy / "config.json").write_text("[1, 2, 3]")
    elif case == "config-field-not-int":
        (_hf_copy / "config.json").write_text(json.dumps({**cfg, "hidden_size": "big"}))
    elif case == "zero-heads":
        (_hf_copy / "config.json").write_text(
            json.dumps({**cfg, "num_attention_heads": 0, "num_key_value_heads": 0}))
    elif case == "generation-config-not-object":
        (_hf_copy / "generation_config.json").write_text("[2]")
    else:
        out.write_text("a file where the output directory should go")
    _convert(capsys, _hf_copy, out, *fragments)
    if case == "output-is-a-file":
        assert out.read_text() == "a file where the output directory should go"  # left as it was


# -- python -m bastion_jax.generate ------------------------------------------------------------

def _generate(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = generate.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_generate_nonexistent_target(capsys, tmp_path):
    rc, out, err = _generate(capsys, "--target", str(tmp_path / "nope"), "--no-chat", "w1 w2")
    assert rc == 2
    assert out == ""
    one_error_line(err, "not found", "nope")


def test_generate_prompt_longer_than_cache(capsys, _tiny):
    prompt = " ".join(_WORDS[:12])  # 12 tokens with the word-level tokenizer
    rc, out, err = _generate(capsys, "--target", str(_tiny["ours"]), "--no-chat", "--max-len", "8",
                             "--max-new-tokens", "2", "--quiet", prompt)
    assert rc == 2, err
    assert out == ""
    line = one_error_line(err, "cache", "12 tokens", "8")
    assert "--max-len" in line  # tells the user how to fix it


def test_generate_prompt_within_cache_succeeds(capsys, _tiny):
    """Control for the test above: the same target and flags with room in the cache work."""
    prompt = " ".join(_WORDS[:12])
    rc, out, err = _generate(capsys, "--target", str(_tiny["ours"]), "--no-chat", "--max-len", "16",
                             "--max-new-tokens", "2", "--quiet", prompt)
    assert rc == 0, err
    assert err == ""
    assert out.endswith("\n")


def test_generate_system_message_without_a_chat_template_is_refused(capsys, _tiny):
    """The tiny tokenizer has no chat template: --system has nowhere to go, so it is refused, not dropped."""
    rc, out, err = _generate(capsys, "--target", str(_tiny["ours"]), "--system", "be brief", "--max-len", "16",
                             "--max-new-tokens", "2", "--quiet", "w1 w2")
    assert rc == 2 and out == ""
    one_error_line(err, "system message", "chat template", "this tokenizer does not have")


def test_generate_max_len_too_small_for_the_answer(capsys, _tiny):
    """The prompt fits but the answer does not: an error naming the numbers, not a 4-token answer."""
    prompt = " ".join(_WORDS[:12])
    rc, out, err = _generate(capsys, "--target", str(_tiny["ours"]), "--no-chat", "--max-len", "16",
                             "--max-new-tokens", "8", "--quiet", prompt)
    assert rc == 2 and out == ""
    one_error_line(err, "--max-len 16", "(12 tokens)", "8 new tokens", "0 slots", "= 20")


def test_generate_block_size_without_random_drafter(capsys, tmp_path):
    # Refused before anything is loaded (the target does not exist).
    rc, out, err = _generate(capsys, "--target", str(tmp_path / "nope"), "--block-size", "4", "w1")
    assert rc == 2 and out == ""
    one_error_line(err, "--block-size", "--drafter random")


@pytest.mark.parametrize("k", ["0", "-1"])
def test_generate_tree_top_k_below_one(capsys, tmp_path, k):
    # Refused before anything is loaded: 0 used to build trees of the lookup chain alone, -1 to fail
    # deep inside top_k after the models had loaded.
    rc, out, err = _generate(capsys, "--target", str(tmp_path / "nope"), "--tree-top-k", k, "w1")
    assert rc == 2 and out == ""
    one_error_line(err, "--tree-top-k must be >= 1", f"got {k}")


def test_engine_refuses_tree_top_k_below_one(_tiny):
    from bastion_jax.checkpoints import load_target
    from bastion_jax.engine import Engine, GenerationError

    target = load_target(_tiny["ours"])
    with pytest.raises(GenerationError, match="tree top-k must be >= 1"):
        Engine(target, stop_ids=[-1], block_size=4, top_k=0)
    assert Engine(target, stop_ids=[-1], block_size=4, top_k=1).top_k == 1


@pytest.mark.parametrize("argv, stdin", [([""], None), (["   \n\t"], None), (["ok", ""], None), ([], "")],
                         ids=["empty", "whitespace", "one-of-two-empty", "empty-stdin"])
def test_generate_empty_prompt(capsys, monkeypatch, tmp_path, argv, stdin):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    # The target does not exist: the prompt must be rejected before anything is loaded.
    rc, out, err = _generate(capsys, "--target", str(tmp_path / "nope"), *argv)
    assert rc == 2
    assert out == ""
    line = one_error_line(err)
    assert str(tmp_path) not in line  # about the prompt, not the (never opened) target
    assert "prompt" in line


@pytest.mark.parametrize("argv,fragments", [
    (["--max-new-tokens", "0"], ("--max-new-tokens", "'0'")),
    (["--max-new-tokens", "abc"], ("--max-new-tokens", "'abc'")),
    (["--dtype", "float16"], ("--dtype", "'float16'")),
    (["--bogus"], ("unrecognized arguments", "--bogus")),
    (["--cond-depths", "1"], ("--cond-depths", "'1'", "N >= 2")),
])
def test_generate_refused_flag_isone_error_line(capsys, argv, fragments):
    """A value argparse refuses is one line too (its own error printed the whole usage block first)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        generate.main([*argv, "w1 w2"])
    assert e.value.code == 2
    one_error_line(capsys.readouterr().err, *fragments, "python -m bastion_jax.generate --help")


def test_convert_and_trainer_refused_flags_areone_error_line(capsys):
    from bastion_jax.train_drafter import main as train_main

    for run, argv, fragments in ((convert_main, [], ("required", "src")),
                                 (train_main, ["train", "--steps", "x"], ("--steps", "'x'", "train --help"))):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            run(argv)
        assert e.value.code == 2
        one_error_line(capsys.readouterr().err, *fragments)


def test_failed_restore_silences_only_its_abandoned_reads(monkeypatch, _tiny):
    """After a failed restore, orbax's reads still in flight report "Event loop is closed" as
    unraisable exceptions (a dozen tracebacks after the error line, when the race goes that way):
    those are dropped, any other unraisable exception still reaches the hook installed before."""
    from bastion_jax.checkpoints.loaders import _quiet_abandoned_reads

    from bastion_jax.checkpoints import load_target

    seen: list[str] = []
    mine = lambda u: seen.append(str(u.exc_value))  # noqa: E731
    monkeypatch.setattr(sys, "unraisablehook", mine)
    load_target(_tiny["ours"])
    assert sys.unraisablehook is mine  # a restore that succeeds leaves the hook as it was

    class RaisesOnDelete:
        def __init__(self, message: str):
            self.message = message

        def __del__(self):
            raise RuntimeError(self.message)

    RaisesOnDelete("Event loop is closed")
    assert seen == ["Event loop is closed"]  # before a failed restore: untouched
    _quiet_abandoned_reads(Path("/nowhere/params"))
    _quiet_abandoned_reads(Path("/nowhere/params"))  # installed once, not wrapped twice
    RaisesOnDelete("Event loop is closed")
    RaisesOnDelete("something else")
    assert seen == ["Event loop is closed", "something else"]


def test_failed_restore_silences_only_its_unretrieved_reads(_tiny, tmp_path, caplog):
    """The other way abandoned reads surface: asyncio logs "Future exception was never retrieved"
    for each failed read nobody awaited (39 lines after the error line in one CI run). After a failed
    restore those naming its params directory are dropped; other asyncio reports still get through,
    and a restore that succeeds leaves the logger as it was."""
    import logging

    from bastion_jax.checkpoints import CheckpointError, load_target

    def report(where: Path) -> None:
        logging.getLogger("asyncio").error(
            "Future exception was never retrieved\nfuture: <Future finished exception=ValueError("
            f"'OUT_OF_RANGE: Error reading in OCDBT database at local file \"{where}/\"')>")

    filters = list(logging.getLogger("asyncio").filters)
    load_target(_tiny["ours"])
    assert logging.getLogger("asyncio").filters == filters
    ckpt = Path(shutil.copytree(_tiny["ours"], tmp_path / "ckpt"))
    data = max((f for f in (ckpt / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[:64])
    caplog.set_level(logging.ERROR, logger="asyncio")
    with pytest.raises(CheckpointError):
        load_target(ckpt)
    caplog.clear()
    report((ckpt / "params").absolute())
    report((tmp_path / "elsewhere" / "params").absolute())
    assert len(caplog.records) == 1 and "elsewhere" in caplog.records[0].getMessage()


@pytest.mark.parametrize("drafter,fragment", [("none", "there is no drafter"),
                                              ("random", "a random drafter has no conditioned head")])
def test_generate_cond_head_on_without_a_head_is_refused(capsys, _tiny, drafter, fragment):
    """--cond-head on asks for the head: without one to use it is refused, not quietly ignored."""
    rc, out, err = _generate(capsys, "--target", str(_tiny["ours"]), "--drafter", drafter, "--cond-head", "on",
                             "--no-chat", "--quiet", "--max-new-tokens", "2", "w1 w2")
    assert rc == 2 and out == ""
    one_error_line(err, "--cond-head on", fragment)


def test_profile_cond_head_on_with_random_models_is_refused(capsys, tmp_path):
    """The profiler's --arch models are random (no conditioned head): --cond-head on is refused there too."""
    from bastion_jax import profile

    capsys.readouterr()
    rc = profile.main(["--arch", "smollm2-135m", "--layers", "1", "--cond-head", "on", "--contexts", "16",
                       "--buckets", "1,4", "--quiet", "--out-dir", str(tmp_path)])
    assert rc == 2
    one_error_line(capsys.readouterr().err, "--cond-head on", "random drafter")


def test_generate_truncated_params_isone_error_line(_tiny, tmp_path):
    """A converted checkpoint whose weights file lost its end: one line, and nothing after it.

    Run as a separate process, since what went wrong came after the error line: orbax's reads still
    in flight when it gave up each printed an "Event loop is closed" traceback, some at exit."""
    import os
    import subprocess

    ckpt = Path(shutil.copytree(_tiny["ours"], tmp_path / "ckpt"))
    data = max((f for f in (ckpt / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[:64])
    cmd = [sys.executable, "-m", "bastion_jax.generate", "--target", str(ckpt), "--no-chat", "--quiet",
           "--max-new-tokens", "2", "w1 w2"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    one_error_line(done.stderr, "corrupt or incompatible checkpoint", "ckpt")


@pytest.mark.parametrize("case,fragments", [
    ("config-not-object", ("config.json", "expected a JSON object")),
    ("metadata-not-object", ("not a bastion_jax target checkpoint", "'v1'")),
    ("unknown-dtype", ("unknown dtype", "'float33'")),
    ("no-dtype", ("names no dtype",)),
])
def test_generate_malformed_checkpoint_isone_error_line(capsys, _tiny, tmp_path, case, fragments):
    """A converted checkpoint with a damaged config.json is refused with one line naming it."""
    ckpt = Path(shutil.copytree(_tiny["ours"], tmp_path / "ckpt"))
    cfg = json.loads((ckpt / "config.json").read_text())
    if case == "config-not-object":
        (ckpt / "config.json").write_text('"bastion_jax"')
    elif case == "metadata-not-object":
        (ckpt / "config.json").write_text(json.dumps({**cfg, "bastion_jax": "v1"}))
    elif case == "no-dtype":  # numpy would read a missing dtype as float64
        del cfg["bastion_jax"]["dtype"]
        (ckpt / "config.json").write_text(json.dumps(cfg))
    else:
        cfg["bastion_jax"]["dtype"] = "float33"
        (ckpt / "config.json").write_text(json.dumps(cfg))
    rc, out, err = _generate(capsys, "--target", str(ckpt), "--no-chat", "--quiet", "w1 w2")
    assert rc == 2 and out == ""
    one_error_line(err, "ckpt", *fragments)


@pytest.mark.parametrize("argv,fragments", [
    (["--system", "Answer in French."], ("--system", "--no-chat")),
    (["--drafter", "none", "--draft-vocab", "100"], ("--draft-vocab 100", "--mode ar")),
    (["--buckets", "1,4,100000"], ("bucket 100000", "context of")),
])
def test_generate_contradictory_flags_are_refused(capsys, _tiny, argv, fragments):
    """Flags that would be silently dropped (a system turn a raw prompt has no place for, a draft
    vocabulary with nothing drafting) or a bucket no cache could hold are one error line, not a run."""
    capsys.readouterr()
    assert generate.main(["--target", str(_tiny["ours"]), "--no-chat", "--quiet", "--max-new-tokens", "2",
                          "--no-calibrate", *argv, "w1 w2"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    one_error_line(err, *fragments)


def _truncated_npz(tmp_path):
    from bastion_jax.training.data import pack_records

    path = pack_records([{"prompt_ids": [1, 2], "response_ids": [3, 4, 5]}] * 4, tmp_path / "ok.npz", 64)
    bad = tmp_path / "truncated.npz"
    bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return bad


@pytest.mark.parametrize("command", [["pack", "--out", "x.jsonl"], ["datastore", "--out", "x.npz"]])
def test_trainer_truncated_packed_file_isone_error_line(capsys, tmp_path, command):
    from bastion_jax.train_drafter import main as train_main

    bad = _truncated_npz(tmp_path)
    capsys.readouterr()
    assert train_main([command[0], "--data", str(bad), *command[1:]]) == 2
    one_error_line(capsys.readouterr().err, str(bad), "not a packed token file")


def test_truncated_datastore_is_one_error(tmp_path):
    from bastion_jax.datastore import DatastoreError, load_datastore

    bad = _truncated_npz(tmp_path)
    with pytest.raises(DatastoreError, match="unreadable datastore"):
        load_datastore(bad)


def test_pack_refuses_records_without_token_lists_and_ids_beyond_its_vocabulary(capsys, tmp_path):
    from bastion_jax.train_drafter import main as train_main

    wrong = tmp_path / "prompts.jsonl"
    wrong.write_text('{"prompt": "a prompt file, not training data"}\n')
    capsys.readouterr()
    assert train_main(["pack", "--data", str(wrong), "--out", str(tmp_path / "x.npz")]) == 2
    one_error_line(capsys.readouterr().err, "record 1", "prompt_ids")
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt_ids": [1, 2], "response_ids": [300]}\n')
    assert train_main(["pack", "--data", str(data), "--out", str(tmp_path / "y.npz"), "--vocab-size", "100"]) == 2
    one_error_line(capsys.readouterr().err, "[1, 300]", "vocabulary of 100")
    assert not (tmp_path / "y.npz").exists()


@pytest.mark.parametrize("argv,fragments", [
    (["train", "--data", "x.npz", "--out", "o", "--lr=-1"], ("--lr", "'-1'", "> 0")),
    (["data", "--num", "0", "--out", "x.jsonl"], ("--num", "'0'")),
])
def test_trainer_refused_values_areone_error_line(capsys, argv, fragments):
    from bastion_jax.train_drafter import main as train_main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_main(argv)
    assert e.value.code == 2
    one_error_line(capsys.readouterr().err, *fragments)


@pytest.mark.parametrize("argv,fragments", [
    (["--matmul-n=-3"], ("--matmul-n", "'-3'")),
    (["--copy-mib", "0"], ("--copy-mib", "'0'")),
])
def test_profile_refused_probe_sizes_areone_error_line(capsys, argv, fragments):
    from bastion_jax.profile import main as profile_main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        profile_main(["--arch", "smollm2-135m", "--layers", "1", *argv])
    assert e.value.code == 2
    one_error_line(capsys.readouterr().err, *fragments)


def test_profile_refuses_drafter_files_with_random_models(capsys, tmp_path):
    from bastion_jax.profile import main as profile_main

    capsys.readouterr()
    assert profile_main(["--arch", "smollm2-135m", "--layers", "1", "--datastore", str(tmp_path / "d.npz"),
                         "--out-dir", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, "--datastore", "--arch builds a random drafter")
