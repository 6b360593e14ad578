"""GGUF files (llama.cpp): metadata -> HF config, dequantised tensors -> HF names.

llama.cpp's converter permutes the rows of Q and K for llama-arch models (interleaved rather than
half-split RoPE pairs); we undo that so the weights fit HF's rotate-half convention.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from bastion_jax.checkpoints.errors import ConversionError
from bastion_jax.checkpoints.source import Source

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _PER_LAYER:
        return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows go from interleaved pairs back to half-split."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_dtype(tensors) -> str:
    """The file's own dtype: the float type of its weight matrices (F32 / F16 / BF16); "float32" when
    any tensor is quantised (those are dequantised to float32) or the types are mixed. 1-D tensors
    (norms) are left out: llama.cpp always stores them in F32."""
    import gguf

    floats = {gguf.GGMLQuantizationType.F32: "float32", gguf.GGMLQuantizationType.F16: "float16",
              gguf.GGMLQuantizationType.BF16: "bfloat16"}
    kinds = {floats.get(t.tensor_type, "quantised") for t in tensors if len(t.shape) > 1}
    return kinds.pop() if len(kinds) == 1 and "quantised" not in kinds else "float32"


def open_gguf(path: Path) -> Source:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/struct errors on corrupt files
        raise ConversionError(f"unreadable GGUF file {path}: {e}") from None
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise ConversionError(f"unknown architecture {arch!r} in {path} (supported: llama, qwen3)")
    tensors = {t.name: t for t in reader.tensors}
    # Metadata that would change the math and that the GGUF path does not read is refused, not ignored.
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ConversionError(f"{path} uses {scaling} RoPE scaling ({arch}.rope.scaling.type), which the GGUF "
                              "path does not support; convert the Hugging Face safetensors checkpoint instead")
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window:
        raise ConversionError(f"{path} has sliding-window attention ({arch}.attention.sliding_window={window}), "
                              "which is not supported: every layer here attends to the whole context")
    if "rope_freqs.weight" in tensors:
        raise ConversionError(
            f"{path} uses llama3 RoPE frequency factors (rope_freqs.weight), which the GGUF path "
            "does not support yet; convert the Hugging Face safetensors checkpoint instead")

    def need(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ConversionError(f"GGUF metadata {arch}.{key} missing in {path}")
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    hf_config = {
        "model_type": arch,
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 8192)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    by_hf = {hf_name(n): n for n in tensors if hf_name(n) is not None}

    def load(name: str) -> np.ndarray:
        t = tensors[by_hf[name]]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ConversionError(f"cannot dequantise {t.name} ({t.tensor_type.name}) in {path}: {e}") from None
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            w = unpermute_qk(w, heads)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            w = unpermute_qk(w, kv_heads)
        return w

    def save_tokenizer(out: Path) -> None:
        """Ordinary tokenizer files (tokenizer.json, tokenizer_config.json, chat template), built
        without torch, so the converted checkpoint never needs the GGUF again."""
        from bastion_jax.gguf_tokenizer import GGUFTokenizerError, load_gguf_tokenizer

        try:
            tok = load_gguf_tokenizer(path)
        except GGUFTokenizerError as e:
            raise ConversionError(str(e)) from None
        tok.save_pretrained(str(out))

    return Source(path, hf_config, list(by_hf), load, save_tokenizer, gguf_dtype(tensors[by_hf[n]] for n in by_hf))
