"""A GGUF file's tokenizer, built without torch.

`AutoTokenizer.from_pretrained(dir, gguf_file=...)` reads the GGUF metadata with transformers' own
GGUF reader, which imports torch -- and torch is only a test dependency here, so a clean install
could not tokenize the default model. The metadata reading is the only torch-bound step: the
`gguf` package (already a dependency) reads the same `tokenizer.*` keys, and transformers'
vocabulary-to-tokenizer mapping (`integrations.gguf.gguf_tokenizer_mapping`) is torch-free. So
this module does what transformers' `get_gguf_tokenizer` does with a different reader, then hands
the result to `convert_gguf_tokenizer` and wraps it like `AutoTokenizer` does. The chat template
comes along in the tokenizer config. `tests/test_gguf_tokenizer.py` checks it against
transformers' own GGUF tokenizer string by string.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# The first transformers release whose GGUF tokenizer mapping is a torch-free module of its own.
MIN_TRANSFORMERS = "5.18"
_NEEDED = ("GGUF_TOKENIZER_MAPPING", "_SPECIAL_TOKENS", "convert_gguf_tokenizer")


class GGUFTokenizerError(ValueError):
    """A GGUF file whose tokenizer cannot be built (unreadable file, missing or unsupported vocabulary)."""


def quiet_transformers() -> None:
    """Import transformers without its "PyTorch was not found" advice: torch is deliberately absent
    from a runtime install, and the advice would tell a new user that something is missing. Only
    transformers' advisory warnings are silenced, and only if the user has not chosen otherwise."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers  # noqa: F401


def _mapping():
    """transformers' GGUF tokenizer mapping module, or a clear error naming the version it needs."""
    quiet_transformers()
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping
    except ImportError:  # older transformers: no such module, or one that imports torch
        mapping = None
    if mapping is None or not all(hasattr(mapping, name) for name in _NEEDED):
        import transformers

        raise GGUFTokenizerError(f"building a tokenizer from a GGUF file needs transformers>={MIN_TRANSFORMERS} "
                                 f"(found {transformers.__version__})")
    return mapping


def _metadata(path: Path) -> dict[str, Any]:
    """`general.architecture` and every `tokenizer.*` key of the file, as plain Python values.

    Only the metadata is parsed; the tensor data stays memory-mapped and unread.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/struct errors on corrupt files
        raise GGUFTokenizerError(f"unreadable GGUF file {path}: {e}") from None
    return {key: field.contents() for key, field in reader.fields.items()
            if key == "general.architecture" or key.startswith("tokenizer.")}


def gguf_tokenizer_parts(path: str | Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """`(architecture, tokenizer_dict, tokenizer_config)` exactly as transformers' `get_gguf_tokenizer`
    builds them, but read with the torch-free `gguf` package."""
    path = Path(path)
    mapping = _mapping()
    metadata = _metadata(path)
    architecture = metadata.get("general.architecture")
    if architecture is None:
        raise GGUFTokenizerError(f"GGUF metadata general.architecture missing in {path}")
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    tokens = tokenizer.get("tokens")
    if not tokens:
        raise GGUFTokenizerError(f"{path} has no vocabulary (GGUF metadata tokenizer.ggml.tokens missing)")

    # The same per-type defaults as transformers' `get_gguf_tokenizer` (see its comments).
    tokenizer_type = tokenizer.get("tokenizer_type")
    if tokenizer_type == "llama":
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":
        tokenizer_config["add_bos_token"] = False

    # A GGUF names its special tokens by id; the tokenizer wants the strings. Undeclared ones are
    # stated as None rather than left out, or the tokenizer invents `<s>`/`</s>`.
    for name, key in mapping._SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= int(token_id) < len(tokens):
            raise GGUFTokenizerError(f"{path}: tokenizer.ggml.{key} = {token_id} is outside the vocabulary "
                                     f"({len(tokens)} tokens)")
        tokenizer_config[name] = tokens[int(token_id)] if token_id is not None else None
    return architecture, tokenizer, tokenizer_config


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer of a GGUF file (a `PreTrainedTokenizerFast`, chat template included), no torch.

    Encodes and decodes like `AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)`, and
    `save_pretrained` writes ordinary tokenizer files that `AutoTokenizer` reloads without the GGUF.
    """
    quiet_transformers()
    import transformers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    architecture, tokenizer_dict, tokenizer_config = gguf_tokenizer_parts(path)
    try:
        backend, extra = _mapping().convert_gguf_tokenizer(architecture, tokenizer_dict)
    except Exception as e:  # unsupported tokenizer type, malformed merges, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GGUFTokenizerError(f"cannot build a tokenizer from {path}: {first}") from None
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # no "special tokens added" chatter on every load
    try:
        return PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path=str(path),
                                       **tokenizer_config, **extra)
    finally:
        transformers.logging.set_verbosity(verbosity)
