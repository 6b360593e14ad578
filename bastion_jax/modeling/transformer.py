"""Target decoder (Llama-3.x / Qwen3) as a Flax NNX module with HF-mirroring attribute names.

`Transformer.embed_tokens`, `.layers[i].self_attn.q_proj.weight`, ... are exactly the HF names
with the leading `model.` dropped, so `bastion_jax.checkpoints` maps checkpoints by rule. With
`TargetConfig.scan_layers` the layers are one stacked module instead (`layers.self_attn...` with a
leading [num_layers] axis, run by `jax.lax.scan`: one compiled layer body however deep the model);
checkpoints keep one tensor per layer either way (`checkpoints.params.match_layout`).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bastion_jax.config import TargetConfig
from bastion_jax.modeling.attention import (Causal, attend_canonical, attend_split, prefix_kernel_mode,
                                            prefix_kernel_setting)
from bastion_jax.modeling.cache import KVCache
from bastion_jax.modeling.layers import (MLP, Embedding, Linear, RMSNorm, apply_rope, project, rope_cos_sin,
                                         rope_inv_freq, row_exact)


class Attention(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, hq, hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kw = dict(use_bias=cfg.attention_bias, dtype=dtype, in_out=cfg.weights_in_out,
                  feature_major=cfg.feature_major, rngs=rngs)
        self.q_proj = Linear(h, hq * d, **kw)
        self.k_proj = Linear(h, hkv * d, **kw)
        self.v_proj = Linear(h, hkv * d, **kw)
        self.o_proj = Linear(hq * d, h, **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.heads = (hq, hkv, d)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: KVCache, layer: int | jax.Array,
                 start: jax.Array | None, mask: jax.Array, active: jax.Array | None) -> tuple[jax.Array, KVCache]:
        b, t, _ = x.shape
        hq, hkv, d = self.heads
        q = self.q_proj(x).reshape(b, t, hq, d)  # [b, t, q_heads, d]
        k = self.k_proj(x).reshape(b, t, hkv, d)  # [b, t, kv_heads, d]
        v = self.v_proj(x).reshape(b, t, hkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Write first, then read slots < start of the written buffer: reading the old buffer inside the
        # prefix loop and writing it afterwards makes XLA copy the whole cache.
        cache = cache.write_layer(layer, k, v, jnp.zeros((b,), jnp.int32) if start is None else start, active)
        k_buf, v_buf, index = cache.layer(layer)
        if start is not None and row_exact(q.dtype) and prefix_kernel_mode(d, k_buf.shape[-2]) is None:
            # bf16 on CPU: a token's logits bit for bit the same in an AR step and in any verify step
            out = attend_canonical(q, k_buf, v_buf, start, k, v, mask, layer=index)
        else:
            out = attend_split(q, k_buf, v_buf, start, k, v, mask, layer=index)  # committed slots < start, then the t new
        return self.o_proj(out), cache


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, use_bias=cfg.mlp_bias, dtype=dtype,
                       in_out=cfg.weights_in_out, feature_major=cfg.feature_major, rngs=rngs)

    def __call__(self, x, cos, sin, cache, layer, start, mask, active=None):
        attn, cache = self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, start, mask, active)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


def stacked_layers(cfg: TargetConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """All decoder layers as one `DecoderLayer` whose parameters carry a leading [num_layers] axis,
    each layer initialised with its own key: what `Transformer` scans over."""

    @nnx.split_rngs(splits=cfg.num_hidden_layers)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(r: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(cfg, dtype=dtype, rngs=r)

    return make(rngs)


@partial(jax.jit, static_argnums=0, static_argnames="prefix")
def _unrolled_layer(graphdef: nnx.GraphDef, params: nnx.State, x, cos, sin, cache: KVCache, layer: jax.Array,
                    start, mask, active, *, prefix: str):
    """One unrolled layer, a nested jit: every layer has the same structure and shapes, so the layer is
    traced and lowered once per step and called 30 times (tracing 30 copies cost ~0.75 s of each SmolLM2
    step's ~1.2 s lowering, on every run: the persistent compilation cache keys on the lowered program).
    XLA inlines the calls before optimising, and `layer` is a constant at each call site, so the
    compiled step is the unrolled one; its weights stay separate arguments (a scan slices them).
    `prefix` (the prefix-attention setting, read at trace time) keys the trace with the shapes, so a
    step compiled after `set_prefix_kernel` does not reuse a layer traced under the old setting."""
    return nnx.merge(graphdef, params)(x, cos, sin, cache, layer, start, mask, active)


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [batch, n_logits, vocab] (fp32)
    cache: KVCache
    taps: jax.Array | None  # [batch, seq, n_taps * hidden]: HF hidden_states[id + 1] of the taps


class Transformer(nnx.Module):
    """Decoder-only LM; see module docstring for the naming rule."""

    def __init__(self, cfg: TargetConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        if cfg.scan_layers:  # `layers.<HF name>` [num_layers, ...]
            self.layers = stacked_layers(cfg, dtype, rngs)
        else:  # `layers[i].<HF name>`
            self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """LM head on final-normed hidden states, accumulated and returned in float32.

        A bf16 product rounded to bf16 ties near-equal logits (argmax then depends on the batch shape
        that produced them, which breaks greedy identity between AR and verification), so the
        matmul itself accumulates into float32 (`preferred_element_type`), not just its result."""
        w = (self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)[...]  # [vocab, hidden]
        return project("...h,vh->...v", hidden, w, jnp.float32, feature_major=self.config.feature_major)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, start: jax.Array | None,
                 mask: jax.Array | Causal, *, tap_layers: Sequence[int] = (),
                 logits_index: jax.Array | None = None, active: jax.Array | None = None) -> ForwardOutput:
        """Run `tokens` `[batch, t]` at RoPE `positions` `[batch, t]`, writing K/V at slots
        `start[b] + i`. Each token attends to every committed slot `< start[b]` and to the new
        tokens that `mask` `[batch, t, t]` shows it (causal, or a tree's ancestors; a prefill passes
        `attention.Causal(lengths)`, which a long prompt attends tile by tile). `start` None: nothing is committed
        yet (a prefill from slot 0; the prefix is not read).

        `logits_index` `[batch, n]` picks which of the t positions get logits (prefill only needs
        the last real one); None means all. `tap_layers` returns the outputs of those decoder
        layers (0-based; the last one after the final norm, as HF's `hidden_states`), concatenated in
        the given order: the DFlash feature tap. Rows with `active[b]` False write no K/V.
        """
        x = self.embed_tokens(tokens)  # [b, t, hidden]
        inv_freq = rope_inv_freq(self.config.rope, self.config.head_dim)  # trace-time constant
        cos, sin = rope_cos_sin(inv_freq, positions, x.dtype)
        last = self.config.num_hidden_layers - 1
        if self.config.scan_layers:
            x, cache, taps = self._scan(x, cos, sin, cache, start, mask, active, tap_layers)
        else:
            taps = {}
            for i, layer in enumerate(self.layers):
                x, cache = _unrolled_layer(*nnx.split(layer), x, cos, sin, cache, jnp.int32(i), start, mask, active,
                                           prefix=prefix_kernel_setting())
                if i in tap_layers and i != last:
                    taps[i] = x
        x = self.norm(x)
        # DFlash taps are HF `hidden_states[id + 1]` (z-lab `extract_context_feature`), and HF's last entry
        # is taken after the final norm: a tap on the last layer reads the normed states.
        tapped = [x if i == last else taps[i] for i in tap_layers]
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[..., None], axis=1)  # [b, n, hidden]
        return ForwardOutput(self.logits(x), cache, jnp.concatenate(tapped, axis=-1) if tapped else None)

    def _scan(self, x, cos, sin, cache: KVCache, start, mask, active, tap_layers: Sequence[int]):
        """The stacked layers under `jax.lax.scan`: one compiled layer body, the stacked cache and a
        buffer of the tapped layers' outputs in the carry. Returns (x, cache, {layer: tap})."""
        n_layers = self.config.num_hidden_layers
        inner = [i for i in tap_layers if i != n_layers - 1]  # the last layer's tap is read after the norm
        slot = np.full(n_layers, -1, np.int32)  # layer -> its row of the tap buffer, -1: not tapped
        slot[inner] = np.arange(len(inner))
        taps = jnp.zeros((max(len(inner), 1),) + x.shape, x.dtype)  # [n_inner_taps, b, t, hidden]
        graphdef, stacked = nnx.split(self.layers)

        def body(carry, xs):
            x, cache, taps = carry
            params, i, s = xs
            x, cache = nnx.merge(graphdef, params)(x, cos, sin, cache, i, start, mask, active)
            if inner:  # one row of the tap buffer rewritten per layer (with itself when not tapped)
                row = jnp.maximum(s, 0)
                taps = taps.at[row].set(jnp.where(s >= 0, x, taps[row]))
            return (x, cache, taps), None

        (x, cache, taps), _ = jax.lax.scan(body, (x, cache, taps), (stacked, jnp.arange(n_layers), jnp.asarray(slot)))
        return x, cache, {i: taps[r] for r, i in enumerate(inner)}
