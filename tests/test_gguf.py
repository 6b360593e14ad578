"""GGUF round trip: a tiny random HF Llama written as llama.cpp would write it, read back by us.

llama.cpp's converter permutes the rows of Q and K (rotate-half RoPE pairs -> interleaved pairs);
`bastion_jax.checkpoints.gguf_file` must undo that with the right head count (num_key_value_heads for
K). The weights are drawn with a large spread (norm weights too) so that a wrong permutation, a
swapped tensor or a wrong head count moves the logits far beyond the tolerance.
"""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from bastion_jax.checkpoints import CheckpointError, load_target
from bastion_jax.modeling.cache import KVCache, causal_mask
from bastion_jax.checkpoints.gguf_file import unpermute_qk

_N_HEADS, _N_KV_HEADS, _LAYERS = 4, 2, 2
_ROPE_THETA, _EPS = 500.0, 1e-5

_PER_LAYER = {  # HF module (under model.layers.N.) -> GGUF tensor (under blk.N.)
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Exactly llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_hf_llama(tied: bool) -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=_LAYERS,
        num_attention_heads=_N_HEADS, num_key_value_heads=_N_KV_HEADS, max_position_embeddings=256,
        rope_theta=_ROPE_THETA, rms_norm_eps=_EPS, tie_word_embeddings=tied,
        attn_implementation="eager")
    torch.manual_seed(1 if tied else 0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))  # not all ones: a swapped norm must show
            else:
                p.copy_(torch.randn_like(p) * 1.8 / p.shape[-1] ** 0.5)  # logits O(1..10)
    return model


def _hf_state(model: transformers.LlamaForCausalLM) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().astype(np.float32) for k, v in model.state_dict().items()}


def _write_gguf(path, model: transformers.LlamaForCausalLM, extra=None) -> None:
    """`extra(writer)` adds metadata (a test of what the reader refuses)."""
    cfg = model.config
    sd = _hf_state(model)
    w = gguf.GGUFWriter(str(path), "llama")
    if extra is not None:
        extra(w)
    w.add_name("tiny-random-llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(_ROPE_THETA)
    w.add_layer_norm_rms_eps(_EPS)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # numpy order, as convert_hf_to_gguf passes them: the writer stores the GGML (reversed) shape.
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, gg in _PER_LAYER.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _llama_cpp_permute(t, cfg.num_attention_heads)
            elif gg == "attn_k":
                t = _llama_cpp_permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _flat(tree, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        out.update(_flat(v, name + ".") if isinstance(v, dict) else {name: np.asarray(v)})
    return out


@pytest.mark.parametrize("n_heads, rows, cols", [(4, 32, 32), (2, 16, 32), (1, 8, 5), (3, 24, 7)])
def test_unpermute_inverts_llama_cpp_permute(n_heads, rows, cols):
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_heads)
    if rows // n_heads > 2:
        assert not np.array_equal(permuted, w)  # the permutation actually moves rows
    np.testing.assert_array_equal(unpermute_qk(permuted, n_heads), w)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_round_trip_matches_hf(tmp_path, tied):
    hf_model = _tiny_hf_llama(tied)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, hf_model)

    target = load_target(path, weights_in_out=False)  # GGUF -> float32 params in memory, HF layout
    cfg = target.config
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == ("llama", 128, 32, 64)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        _LAYERS, _N_HEADS, _N_KV_HEADS, 8)
    assert cfg.tie_word_embeddings is tied
    assert cfg.rope.theta == pytest.approx(_ROPE_THETA)
    assert cfg.rms_norm_eps == pytest.approx(_EPS)
    assert cfg.max_position_embeddings == 256
    assert target.dtype == jnp.float32

    # Every parameter equals the HF tensor of the same name (minus `model.`), bit for bit.
    ours = _flat(nnx.to_pure_dict(target.state))
    theirs = {k.removeprefix("model."): v for k, v in _hf_state(hf_model).items()}
    if tied:
        del theirs["lm_head.weight"]  # tied: HF's lm_head is the embedding; we have no lm_head
    assert sorted(ours) == sorted(theirs)
    for name, want in theirs.items():
        np.testing.assert_array_equal(ours[name], want, err_msg=name)

    # And the forward pass agrees with transformers on a random sequence.
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(1, 24)).astype(np.int32)
    with torch.no_grad():
        want = hf_model(torch.from_numpy(tokens).long()).logits[0].numpy()
    model = nnx.merge(target.graphdef, target.state)
    t = tokens.shape[1]
    start = jnp.zeros((1,), jnp.int32)
    out = model(jnp.asarray(tokens), jnp.arange(t, dtype=jnp.int32)[None], KVCache.create(cfg, 1, t, jnp.float32),
                start, causal_mask(start.shape[0], t))
    got = np.asarray(out.logits[0])
    assert got.shape == want.shape == (t, cfg.vocab_size)
    assert np.abs(want).max() > 0.5  # logits large enough for the tolerance to mean something
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("extra, needle", [
    (lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN), "yarn RoPE scaling"),
    (lambda w: w.add_sliding_window(16), "sliding-window attention"),
], ids=["yarn", "sliding"])
def test_gguf_metadata_that_changes_the_math_is_refused(tmp_path, extra, needle):
    """A YaRN or sliding-window GGUF must not load as a plain full-attention model."""
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _tiny_hf_llama(False), extra)
    with pytest.raises(CheckpointError, match=needle):
        load_target(path, weights_in_out=False)
    plain = tmp_path / "plain.gguf"  # the same file without it loads
    _write_gguf(plain, _tiny_hf_llama(False), lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.NONE))
    assert load_target(plain, weights_in_out=False).config.num_hidden_layers == _LAYERS
