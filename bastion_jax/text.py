"""Tokenizer loading, chat-template prompts and incremental detokenisation (transformers does the work)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bastion_jax.checkpoints import Target


def load_tokenizer(target: "Target"):
    """The target's tokenizer, never through torch.

    A GGUF target's tokenizer is built from the file's metadata by `bastion_jax.gguf_tokenizer`
    (transformers' own `gguf_file=` path imports torch, a test-only dependency); any other target
    dir holds ordinary tokenizer files (a converted GGUF checkpoint included: the converter saves
    them), which `AutoTokenizer` reads without torch; a converted checkpoint's straight into the class
    `AutoTokenizer` would pick (`_plain_fast_tokenizer`), without its detour through torch.
    """
    from bastion_jax.checkpoints import CheckpointError
    from bastion_jax.gguf_tokenizer import GGUFTokenizerError, load_gguf_tokenizer, quiet_transformers

    quiet_transformers()
    import transformers

    transformers.logging.set_verbosity_error()
    if target.tokenizer_gguf:
        try:
            return load_gguf_tokenizer(Path(target.tokenizer_dir) / target.tokenizer_gguf)
        except GGUFTokenizerError as e:
            raise CheckpointError(str(e)) from None
    try:
        if _plain_fast_tokenizer(Path(target.tokenizer_dir)):
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(str(target.tokenizer_dir))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(target.tokenizer_dir))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"no usable tokenizer in {target.tokenizer_dir} (need tokenizer.json or "
                              f"tokenizer_config.json, or a GGUF file): {first}") from None


# Architectures whose tokenizer `AutoTokenizer` builds as the class a fast tokenizer's config names
# (transformers 5 maps some others, qwen2 among them, to a registered class of their own).
PLAIN_TOKENIZER_TYPES = ("llama", "qwen3")


def _plain_fast_tokenizer(directory: Path) -> bool:
    """True where `AutoTokenizer` would hand back a plain `TokenizersBackend` read from tokenizer.json:
    a fast tokenizer's config (class TokenizersBackend / PreTrainedTokenizerFast, no remote code) beside
    a model config of a `PLAIN_TOKENIZER_TYPES` architecture, as every converted checkpoint has. Why:
    `AutoTokenizer` first imports the model-config machinery, and with it torch where torch is installed
    (~2.5-4 s of every load on a 2-core CPU), to arrive at that same class; `tests/test_text.py` holds
    the two to the same tokenizer."""
    from bastion_jax.config import read_config_json

    try:
        tok_cfg = json.loads((directory / "tokenizer_config.json").read_text())
        model_type = read_config_json(directory / "config.json").get("model_type")
    except (OSError, ValueError):  # (ConfigError is a ValueError)
        return False
    return (isinstance(tok_cfg, dict) and (directory / "tokenizer.json").is_file() and "auto_map" not in tok_cfg
            and tok_cfg.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")
            and model_type in PLAIN_TOKENIZER_TYPES)


def encode_prompt(tokenizer, text: str, *, chat: bool = True, system: str | None = None) -> list[int]:
    """Token ids for one user turn, through the chat template when the tokenizer has one. A `system`
    message only has a place in the template, so without one (or with `chat=False`) it is refused
    rather than dropped."""
    templated = chat and getattr(tokenizer, "chat_template", None)
    if system and not templated:
        raise ValueError("a system message goes into the chat template, which "
                         + ("this tokenizer does not have" if chat else "chat=False leaves out"))
    if templated:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def stop_ids(tokenizer, config_eos: tuple[int, ...]) -> frozenset[int]:
    ids = set(config_eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without splitting multi-byte characters."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more tokens
            return ""
        delta, self.emitted = text[self.emitted:], len(text)
        return delta

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        delta, self.emitted = text[self.emitted:], len(text)
        return delta
