"""The drafter's training forward: many blocks of one sequence at once, and the matmul it runs on.

`Drafter.forward_blocks` (the reference, in modeling/) attends every block query over
[context | all blocks] with a block-diagonal mask: with N blocks of B slots, N-1 of every N block
keys are masked out, so with 32 anchors 60% of the attention work is wasted. Here each block
attends to the shared context (prefix-masked at its anchor) plus its own B slots only: the same
softmax over the same visible keys in the same order (masked keys contribute exactly 0), so the
result equals the reference (tests check it against real drafting calls).

Dense layers run through `matmul`, which in float32 is the modules' own einsum and in bfloat16 is
mixed precision: bf16 operands, float32 accumulation and results, float32 master weights and
float32 norms, softmax and residual stream. On this machine's AVX512-BF16 CPU that doubles matmul
throughput (measured: ~190 GFLOP/s float32, ~350-400 bf16 -> f32), which is most of a step.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from bastion_jax.modeling.cache import KVCache, causal_mask
from bastion_jax.modeling.layers import ACTIVATIONS, apply_rope, rope_cos_sin, rope_inv_freq
from bastion_jax.training.objective import Blocks, Objective, make_blocks


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_mixed(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    return jnp.einsum("...i,oi->...o", x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)


def _matmul_mixed_fwd(x, w, dtype):
    xc, wc = x.astype(dtype), w.astype(dtype)
    return jnp.einsum("...i,oi->...o", xc, wc, preferred_element_type=jnp.float32), (xc, wc)


def _matmul_mixed_bwd(dtype, res, g):
    """Cotangents of float32 x and w (what `matmul` passes), from bf16 products accumulated in float32."""
    xc, wc = res
    gc = g.astype(dtype)  # [..., o]
    dx = jnp.einsum("...o,oi->...i", gc, wc, preferred_element_type=jnp.float32)  # [..., i]
    # dW [o, i] = sum over tokens of g^T x. Written with a unit batch axis on purpose: XLA:CPU sends
    # the plain 2-D form (contracting the leading axis) to a generic kernel at ~145 GFLOP/s and this
    # one to the bf16 kernel at ~300-370 (jax 0.10.2, measured on the training shapes).
    g2, x2 = gc.reshape(1, -1, gc.shape[-1]), xc.reshape(1, -1, xc.shape[-1])
    dw = jnp.einsum("bto,bti->oi", g2, x2, preferred_element_type=jnp.float32)
    return dx, dw


_matmul_mixed.defvjp(_matmul_mixed_fwd, _matmul_mixed_bwd)


def matmul(x: jax.Array, w: jax.Array, dtype=jnp.float32) -> jax.Array:
    """x [..., in] @ w[out, in]^T -> [..., out] float32, with operands in `dtype` (float32 or bfloat16)."""
    if jnp.dtype(dtype) == jnp.float32:
        return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), w.astype(jnp.float32),
                          preferred_element_type=jnp.float32)
    return _matmul_mixed(x.astype(jnp.float32), w.astype(jnp.float32), jnp.dtype(dtype))


def _linear(mod, x: jax.Array, dtype) -> jax.Array:
    """A `layers.Linear` applied through `matmul` (same weights, bias added in float32)."""
    y = matmul(x, mod.weight[...], dtype)
    return y if mod.bias is None else y + mod.bias[...].astype(jnp.float32)


def target_features(target, tokens: jax.Array, tap_layers: tuple[int, ...], cache_dtype) -> jax.Array:
    """Tapped target layer outputs for whole sequences tokens [b, S] -> [b, S, n_taps * hidden]."""
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
    cache = KVCache.create(target.config, b, s, cache_dtype)
    out = target(tokens, positions, cache, None, causal_mask(b, s), tap_layers=tap_layers,
                 logits_index=jnp.zeros((b, 1), jnp.int32))
    return jax.lax.stop_gradient(out.taps)


def drafter_blocks(drafter, block_emb: jax.Array, positions: jax.Array, anchors: jax.Array, valid: jax.Array,
                   features: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Final-normed drafter hidden states [b, N, B, h] of N blocks per row.

    block_emb: [b, N, B, h] target embeddings of `[x_p, MASK...]`; positions: [b, N, B] RoPE
    positions p..p+B-1; anchors/valid: [b, N] (block n sees context positions < anchors[n]; an
    invalid block sees none); features: [b, S, n_taps * h] target taps of the whole row.
    """
    cfg = drafter.config
    b, n, blk, h = block_emb.shape
    s = features.shape[1]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv_freq = rope_inv_freq(cfg.rope, d)
    rope_blk = rope_cos_sin(inv_freq, positions.reshape(b, n * blk), jnp.float32)  # [b, T, d] each
    rope_ctx = rope_cos_sin(inv_freq, jnp.broadcast_to(jnp.arange(s)[None], (b, s)), jnp.float32)  # [b, S, d]
    sees = jnp.arange(s)[None, None, :] < jnp.where(valid, anchors, 0)[:, :, None]  # [b, N, S]
    bias = jnp.where(sees, 0.0, -jnp.inf)  # masked context keys get exactly zero probability
    x_ctx = drafter.hidden_norm(_linear(drafter.fc, features, dtype))  # [b, S, h]

    def kv(attn, x, rope):  # the module's `_kv`: [b, t, kv_heads, d] each
        t = x.shape[1]
        k = apply_rope(attn.k_norm(_linear(attn.k_proj, x, dtype).reshape(b, t, hkv, d)), *rope)
        return k, _linear(attn.v_proj, x, dtype).reshape(b, t, hkv, d)

    x = block_emb.reshape(b, n * blk, h).astype(jnp.float32)  # [b, T, h] residual stream
    for layer in drafter.layers:
        attn = layer.self_attn
        k_ctx, v_ctx = kv(attn, x_ctx, rope_ctx)  # [b, S, kv, d]
        u = layer.input_layernorm(x)
        q = apply_rope(attn.q_norm(_linear(attn.q_proj, u, dtype).reshape(b, n * blk, hq, d)), *rope_blk)
        k_blk, v_blk = kv(attn, u, rope_blk)  # [b, T, kv, d]
        q = q.reshape(b, n, blk, hkv, hq // hkv, d) * d ** -0.5  # [b, N, B, kv, groups, d]
        k_blk, v_blk = k_blk.reshape(b, n, blk, hkv, d), v_blk.reshape(b, n, blk, hkv, d)
        # One softmax over [context | own block] without materialising the concatenation.
        s_ctx = jnp.einsum("bnqkgd,bskd->bknqgs", q, k_ctx) + bias[:, None, :, None, None, :]  # [b, kv, N, B, g, S]
        s_own = jnp.einsum("bnqkgd,bnpkd->bknqgp", q, k_blk)  # [b, kv, N, B, g, B]
        top = jax.lax.stop_gradient(jnp.maximum(s_ctx.max(-1, keepdims=True), s_own.max(-1, keepdims=True)))
        e_ctx, e_own = jnp.exp(s_ctx - top), jnp.exp(s_own - top)
        total = e_ctx.sum(-1, keepdims=True) + e_own.sum(-1, keepdims=True)  # >= 1: the max term is exp(0)
        out = (jnp.einsum("bknqgs,bskd->bnqkgd", e_ctx / total, v_ctx)
               + jnp.einsum("bknqgp,bnpkd->bnqkgd", e_own / total, v_blk))  # [b, N, B, kv, groups, d]
        x = x + _linear(attn.o_proj, out.reshape(b, n * blk, hq * d), dtype)
        mlp, v = layer.mlp, layer.post_attention_layernorm(x)
        x = x + _linear(mlp.down_proj, ACTIVATIONS[mlp.act](_linear(mlp.gate_proj, v, dtype))
                        * _linear(mlp.up_proj, v, dtype), dtype)
    return drafter.norm(x).reshape(b, n, blk, h)


def teacher_logits(final: jax.Array, positions: jax.Array, head: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The target's logits for the label of every drafted slot: slot k of a block at anchor p predicts
    x_{p+k}, which the target predicts from position p+k-1 (its final normed hidden state there).

    final: [b, S, h] final normed target hidden states; positions: [b, N, B] the blocks' positions
    p..p+B-1; head: [n_vocab, h] the loss vocabulary's LM-head rows. Returns [b, N, B-1, n_vocab]
    float32 (slots past the sequence read its last position; their labels carry no weight)."""
    b, s, h = final.shape
    n, blk = positions.shape[1], positions.shape[2]
    logits = matmul(final, head, dtype)  # [b, S, n_vocab]: each position once, however many blocks read it
    prev = jnp.minimum(positions[:, :, :-1], s - 1).reshape(b, n * (blk - 1))  # [b, N*(B-1)]
    out = jnp.take_along_axis(logits, prev[:, :, None], axis=1)  # [b, N*(B-1), n_vocab]
    return jax.lax.stop_gradient(out.reshape(b, n, blk - 1, -1))


def anchored_forward(drafter, embed: jax.Array, features: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
                     anchors: jax.Array, valid: jax.Array, obj: Objective, matmul_dtype: str = "float32",
                     condition: bool = True) -> tuple[jax.Array, Blocks]:
    """Hidden states [b, N, B-1, h] of slots 1..B-1 of the blocks at anchors [b, N] (valid [b, N]), and
    the blocks. embed: [V, h] the target's embedding table; features: [b, S, F] the rows' drafter taps.
    `condition`: through the drafter's conditioned head, if it has one (else the states before it)."""
    blocks = make_blocks(tokens, loss_mask, anchors, valid, obj)
    emb = jnp.take(embed, blocks.ids, axis=0)  # [b, N, B, h]
    hidden = drafter_blocks(drafter, emb, blocks.positions, anchors, valid, features.astype(jnp.float32),
                            jnp.dtype(matmul_dtype))[:, :, 1:]  # slot 0 is the anchor itself: untrained
    if condition:
        hidden = conditioned(drafter, embed, hidden, tokens, blocks.positions, jnp.dtype(matmul_dtype))
    return hidden, blocks


def conditioned(drafter, embed: jax.Array, hidden: jax.Array, tokens: jax.Array, positions: jax.Array,
                dtype) -> jax.Array:
    """Slots 1..B-1's hidden states [b, N, B-1, h] through the drafter's conditioned head, if it has
    one (`modeling/cond_head.py`), each given the true tokens before it (the block's root for slot 1):
    teacher forcing, which for a chain is exactly what drafting sees while its run lasts.
    positions: [b, N, B] the blocks' positions in tokens [b, S]."""
    head = drafter.cond_head
    if head is None:
        return hidden
    b, n, blk = positions.shape
    prev_pos = jnp.minimum(positions[:, :, :-1], tokens.shape[1] - 1).reshape(b, n * (blk - 1))
    prev = jnp.take_along_axis(tokens, prev_pos, axis=1).reshape(b, n, blk - 1)  # [b, N, B-1]
    x = jnp.concatenate([hidden, jnp.take(embed, prev, axis=0).astype(hidden.dtype)], axis=-1)  # [b, N, B-1, 2h]
    pre = _linear(head.fc1, x, dtype)  # [b, N, B-1, rank]
    if head.rec is None:
        u = jax.nn.silu(pre)
    else:  # u_k = silu(pre_k + rec u_{k-1}), u_0 = 0: a scan over the block's slots

        def slot(state: jax.Array, pre_k: jax.Array) -> tuple[jax.Array, jax.Array]:
            u_k = jax.nn.silu(pre_k + _linear(head.rec, state, dtype))
            return u_k, u_k

        _, u = jax.lax.scan(slot, jnp.zeros_like(pre[:, :, 0]), jnp.moveaxis(pre, 2, 0))
        u = jnp.moveaxis(u, 0, 2)  # [b, N, B-1, rank]
    return hidden + _linear(head.fc2, u, dtype)
