"""Hugging Face checkpoint directories: config.json + (sharded) safetensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from bastion_jax.checkpoints.errors import ConversionError
from bastion_jax.checkpoints.source import Source

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json",
    "added_tokens.json",
)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"unreadable {path.name} in {path.parent}: {e}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"unreadable {path.name} in {path.parent}: expected a JSON object")
    return data


def _weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the shard index or by listing the files."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        wm = _read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise ConversionError(f"{index} has no weight_map")
        return {name: directory / fname for name, fname in wm.items()}
    # (a conditioned head's file beside a DFlash drafter is not a shard: `checkpoints/cond_head.py`)
    files = sorted(f for f in directory.glob("*.safetensors") if f.name != "cond_head.safetensors")
    if not files:
        raise ConversionError(f"no *.safetensors files in {directory}")
    out: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(f, framework="numpy") as st:
                out.update({name: f for name in st.keys()})
        except (SafetensorError, OSError) as e:
            raise ConversionError(f"unreadable safetensors file {f}: {e}") from None
    return out


def hf_generation_eos(directory: Path) -> list[int]:
    """EOS ids from generation_config.json (instruct models often list several there)."""
    gen = directory / "generation_config.json"
    if not gen.is_file():
        return []
    eos = _read_json(gen).get("eos_token_id")
    try:
        return [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    except (TypeError, ValueError):
        raise ConversionError(f"malformed eos_token_id {eos!r} in {gen}") from None


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def hf_dtype(hf_config: dict, weight_map: dict[str, Path]) -> str | None:
    """The checkpoint's own dtype: `torch_dtype` (or transformers 5's `dtype`) in config.json, else the
    most common float dtype among the safetensors headers (no tensor data is read)."""
    named = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if isinstance(named, str) and named != "auto":
        return named.removeprefix("torch.")
    counts: dict[str, int] = {}
    for f in sorted(set(weight_map.values())):
        try:
            with safe_open(f, framework="numpy") as st:
                for name in st.keys():
                    code = st.get_slice(name).get_dtype()
                    if code in _SAFETENSORS_DTYPES:
                        counts[_SAFETENSORS_DTYPES[code]] = counts.get(_SAFETENSORS_DTYPES[code], 0) + 1
        except (SafetensorError, OSError) as e:
            raise ConversionError(f"unreadable safetensors file {f}: {e}") from None
    return max(counts, key=counts.get) if counts else None


def open_hf(directory: Path) -> Source:
    if not (directory / "config.json").is_file():
        raise ConversionError(f"no config.json in {directory}")
    hf_config = _read_json(directory / "config.json")
    extra_eos = hf_generation_eos(directory)
    if extra_eos:
        eos = hf_config.get("eos_token_id")
        base = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        hf_config["eos_token_id"] = list(dict.fromkeys(base + extra_eos))
    weight_map = _weight_map(directory)

    def load(name: str) -> np.ndarray:
        f = weight_map[name]
        try:
            with safe_open(f, framework="numpy") as st:
                return st.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ConversionError(f"unreadable tensor {name} in {f}: {e}") from None

    def save_tokenizer(out: Path) -> None:
        for fname in TOKENIZER_FILES:
            if (directory / fname).is_file():
                shutil.copy2(directory / fname, out / fname)

    return Source(directory, hf_config, list(weight_map), load, save_tokenizer, hf_dtype(hf_config, weight_map))
