"""DFlash drafter: predicts a whole block of next tokens in one forward from target features.

Attribute names mirror the z-lab checkpoint keys (`fc`, `hidden_norm`, `layers.i.self_attn.q_proj`,
...). The drafter has no embedding or LM head: both are borrowed from the target.

Context ("KV injection"): the tapped target features of committed tokens are projected once
(`fc` -> `hidden_norm`) and every layer turns them into extra keys/values with its own
`k_proj`/`v_proj`/`k_norm` (with their biases when `attention_bias`). Those context K/V are kept
in a preallocated cache by absolute position; the block's own K/V are transient. The block
`[root, MASK x (B-1)]` attends bidirectionally to itself and to every committed context position:
the cached context (read up to its live length, never concatenated) and the context written by
this very call, merged exactly (`attention.attend_split`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from bastion_jax.dflash_config import DrafterConfig
from bastion_jax.modeling.cache import KVCache
from bastion_jax.modeling.attention import attend, attend_split
from bastion_jax.modeling.cond_head import CondHead
from bastion_jax.modeling.layers import MLP, Linear, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq

# The fewest new context rows a drafting call projects; more in sizes that double up to the buffer
# (`Drafter.new_context_kv`).
INJECT_FIRST_ROWS = 4


class DrafterAttention(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, hq, hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # Qwen3 attention: all four projections carry a bias, or none does
        kw = dict(use_bias=cfg.attention_bias, dtype=dtype, feature_major=cfg.feature_major, rngs=rngs)
        self.q_proj = Linear(h, hq * d, **kw)
        self.k_proj = Linear(h, hkv * d, **kw)
        self.v_proj = Linear(h, hkv * d, **kw)
        self.o_proj = Linear(hq * d, h, **kw)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.heads = (hq, hkv, d)

    def _kv(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, t, _ = x.shape
        _, hkv, d = self.heads
        k = apply_rope(self.k_norm(self.k_proj(x).reshape(b, t, hkv, d)), cos, sin)
        return k, self.v_proj(x).reshape(b, t, hkv, d)

    def context_kv(self, x_ctx: jax.Array, rope_ctx: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """Keys/values injected from projected target features x_ctx [b, C, h]: [b, C, kv_heads, d] each."""
        return self._kv(x_ctx, *rope_ctx)

    def __call__(self, u: jax.Array, rope_blk: tuple[jax.Array, jax.Array], ctx_k: jax.Array, ctx_v: jax.Array,
                 mask: jax.Array, cached: tuple[jax.Array, jax.Array, int | None, jax.Array] | None = None) -> jax.Array:
        """u: [b, T, h] normed block tokens; ctx_k/ctx_v: [b, S, kv_heads, d] context K/V;
        mask: [b, T, S + T] over [context | block] keys. Inference passes one block (T = B, the
        block part all-visible) and `cached` = (k_cache, v_cache, layer, length [b]) as `KVCache.layer` gives them:
        older context, every slot < length visible; training passes many blocks at once with a
        block-diagonal part and no cache."""
        b, t, _ = u.shape
        hq, _, d = self.heads
        q = apply_rope(self.q_norm(self.q_proj(u).reshape(b, t, hq, d)), *rope_blk)  # [b, T, q_heads, d]
        k_blk, v_blk = self._kv(u, *rope_blk)  # [b, T, kv_heads, d]
        keys = jnp.concatenate([ctx_k.astype(q.dtype), k_blk], axis=1)  # [b, S + T, kv_heads, d]
        vals = jnp.concatenate([ctx_v.astype(q.dtype), v_blk], axis=1)
        if cached is None:
            return self.o_proj(attend(q, keys, vals, mask))
        k_cache, v_cache, layer, length = cached
        return self.o_proj(attend_split(q, k_cache, v_cache, length, keys, vals, mask, layer=layer))


class DrafterLayer(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = DrafterAttention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act=cfg.hidden_act, dtype=dtype,
                       feature_major=cfg.feature_major, rngs=rngs)

    def __call__(self, h, rope_blk, ctx_k, ctx_v, mask, cached=None):
        h = h + self.self_attn(self.input_layernorm(h), rope_blk, ctx_k, ctx_v, mask, cached)
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        n_feat = len(cfg.target_layer_ids) * cfg.target_hidden_size
        self.fc = Linear(n_feat, cfg.hidden_size, dtype=dtype, feature_major=cfg.feature_major, rngs=rngs)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.scan_layers:  # `layers.<HF name>` [num_layers, ...], run under a scan
            self.layers = stacked_drafter_layers(cfg, dtype, rngs)
        else:  # `layers[i].<HF name>`
            self.layers = nnx.List([DrafterLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        # The optional head that conditions each slot's law on the tokens before it (after `norm`).
        self.cond_head = CondHead(cfg.hidden_size, cfg.cond_head_rank, recurrent=cfg.cond_head_recurrent, dtype=dtype,
                                  rngs=rngs) if cfg.cond_head_rank else None

    def __call__(self, block_emb: jax.Array, ctx_features: jax.Array, ctx_start: jax.Array | None,
                 ctx_len: jax.Array, cache: KVCache, active: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """One drafting call.

        block_emb: [b, B, h] target embeddings of [root, MASK...]; ctx_features: [b, C, n_taps*h]
        features of the newly committed tokens at positions ctx_start + i (only the first ctx_len
        rows are real; the rest are padding). The root sits at s = ctx_start + ctx_len. `ctx_start`
        None: nothing is cached yet (the prefill's first block; the cache's prefix is not read, as
        the target's prefill does not read its own).
        Returns the final-normed block hidden states [b, B, h] and the cache with the new context
        (rows with `active[b]` False keep their cache unchanged).
        """
        b, block, _ = block_emb.shape
        c = ctx_features.shape[1]
        empty = ctx_start is None
        if empty:
            ctx_start = jnp.zeros((b,), jnp.int32)
        s = ctx_start + ctx_len  # [b]
        inv_freq = rope_inv_freq(self.config.rope, self.config.head_dim)
        dtype = block_emb.dtype
        rope_blk = rope_cos_sin(inv_freq, s[:, None] + jnp.arange(block)[None], dtype)
        new_visible = jnp.arange(c)[None, :] < ctx_len[:, None]  # [b, C]: the real new context rows
        mask = jnp.concatenate([jnp.broadcast_to(new_visible[:, None, :], (b, block, c)),
                                jnp.ones((b, block, block), bool)], axis=-1)  # [b, B, C + B]
        # [layers, b, C, kv_heads, d]; a prompt's pass computes every row (its C is the prompt's bucket)
        k_all, v_all = self.new_context_kv(ctx_features, ctx_start, None if empty else ctx_len, dtype)
        cache = cache.write_all(k_all, v_all, ctx_start, active)  # every layer before any layer reads
        read_len = None if empty else ctx_start  # cache slots < ctx_start

        def run(layer, h, k, v, i):
            return layer(h, rope_blk, k, v, mask, (*cache.layer(i), read_len))

        return self.norm(self._over_layers(run, block_emb, k_all, v_all)), cache

    def inject(self, ctx_features: jax.Array, ctx_start: jax.Array, ctx_len: jax.Array, cache: KVCache,
               dtype: jnp.dtype, active: jax.Array | None = None) -> KVCache:
        """Write context K/V for `ctx_features` [b, C, n_taps*h] (the first ctx_len[b] real) at
        positions ctx_start + i, without drafting a block: exactly what `__call__` (with block
        embeddings of `dtype`) does to the cache, for steps that only catch the drafter up."""
        return cache.write_all(*self.new_context_kv(ctx_features, ctx_start, ctx_len, dtype), ctx_start, active)

    def new_context_kv(self, ctx_features: jax.Array, ctx_start: jax.Array, ctx_len: jax.Array | None,
                       dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """Every layer's K/V [layers, b, C, kv_heads, d] of the new context rows `ctx_features`
        [b, C, n_taps*h] at positions ctx_start + i, of which only the first ctx_len[b] are real
        (None: every row is computed, as a prompt's pass does, and as every call does off XLA:CPU).

        Why: a step's feature buffer is padded to a static C (twice the block) and a step usually
        injects a few rows (the accepted path + 1); projecting every padded row through `fc` and each
        layer's k/v was about half of this function's time at C = 32 (SmolLM2, CPU). So only the first
        n rows are computed, n the smallest of 4, 8, 16, ... C that covers the longest row (a
        `lax.switch` over the features alone: no cache goes through it; one pass, so the weights are
        read once), the rest left zero. They are padding either way: masked in this call, never read
        from the cache before a later call overwrites them (reads stop at the live length)."""
        c = ctx_features.shape[1]
        inv_freq = rope_inv_freq(self.config.rope, self.config.head_dim)

        def kv(n: int, feats: jax.Array) -> tuple[jax.Array, jax.Array]:
            rope = rope_cos_sin(inv_freq, ctx_start[:, None] + jnp.arange(n)[None], dtype)
            k, v = self.context_kv(self.project(feats[:, :n].astype(dtype)), rope)  # [layers, b, n, kv_heads, d]
            pad = [(0, 0), (0, 0), (0, c - n), (0, 0), (0, 0)]
            return jnp.pad(k, pad), jnp.pad(v, pad)

        sizes = [INJECT_FIRST_ROWS]
        while sizes[-1] < c:
            sizes.append(2 * sizes[-1])
        sizes = [min(n, c) for n in sizes]
        if ctx_len is None or len(sizes) == 1 or jax.default_backend() != "cpu":
            # (measured on XLA:CPU; an accelerator reads the weights once either way, and the
            # switch's branches would only add kernels to compile)
            return kv(c, ctx_features)
        longest = jnp.max(ctx_len)
        branch = sum((longest > n).astype(jnp.int32) for n in sizes[:-1])  # the first size >= longest
        return jax.lax.switch(branch, [partial(kv, n) for n in sizes], ctx_features)

    def context_kv(self, x_ctx: jax.Array, rope_ctx: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """Every layer's context K/V from projected features x_ctx [b, C, h]: [layers, b, C, kv_heads, d]
        each, written to the cache in one scatter before any layer reads it. (A layer's context K/V does
        not depend on the layer below, so written one layer at a time XLA may schedule layer i + 1's
        write before layer i's read and then copies the whole stacked cache to keep both.)"""
        if not self.config.scan_layers:
            kv = [layer.self_attn.context_kv(x_ctx, rope_ctx) for layer in self.layers]
            return jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv])
        graphdef, stacked = nnx.split(self.layers)

        def one(_, params):
            return None, nnx.merge(graphdef, params).self_attn.context_kv(x_ctx, rope_ctx)

        return jax.lax.scan(one, None, stacked)[1]

    def _over_layers(self, run, h: jax.Array, k_all: jax.Array, v_all: jax.Array) -> jax.Array:
        """h through every layer, `run(layer, h, ctx_k, ctx_v, i)` each, with layer i's context K/V
        k_all[i] / v_all[i]: a Python loop over `nnx.List` layers, or one scanned body over the stacked
        layers (`scan_layers`: XLA:GPU's compile time follows the kernel count, ~70 per layer)."""
        if not self.config.scan_layers:
            for i, layer in enumerate(self.layers):
                h = run(layer, h, k_all[i], v_all[i], i)
            return h
        graphdef, stacked = nnx.split(self.layers)

        def body(h, xs):
            params, k, v, i = xs
            return run(nnx.merge(graphdef, params), h, k, v, i), None

        n = self.config.num_hidden_layers
        return jax.lax.scan(body, h, (stacked, k_all, v_all, jnp.arange(n)))[0]

    def project(self, features: jax.Array) -> jax.Array:
        """Fused target features [..., n_taps * target_hidden] -> drafter context states [..., h]."""
        return self.hidden_norm(self.fc(features))

    def forward_blocks(self, block_emb: jax.Array, block_positions: jax.Array, ctx_features: jax.Array,
                       mask: jax.Array) -> jax.Array:
        """Many blocks over one whole sequence in one forward (training).

        block_emb: [b, T, h] with T = n_blocks * B; block_positions: [b, T] RoPE positions;
        ctx_features: [b, S, n_taps * h] features of every position of the sequence (context K/V
        at positions 0..S-1); mask: [b, T, S + T] over [context | blocks]. Same layers and math
        as `__call__`, which is the special case of one block and a cache holding the context.
        Returns final-normed hidden states [b, T, h].
        """
        s_len = ctx_features.shape[1]
        inv_freq = rope_inv_freq(self.config.rope, self.config.head_dim)
        dtype = block_emb.dtype
        rope_blk = rope_cos_sin(inv_freq, block_positions, dtype)
        ctx_pos = jnp.broadcast_to(jnp.arange(s_len)[None], ctx_features.shape[:2])
        rope_ctx = rope_cos_sin(inv_freq, ctx_pos, dtype)
        x_ctx = self.project(ctx_features.astype(dtype))  # [b, S, h]
        k_all, v_all = self.context_kv(x_ctx, rope_ctx)  # [layers, b, S, kv_heads, d]

        def run(layer, h, k, v, i):
            return layer(h, rope_blk, k, v, mask)

        return self.norm(self._over_layers(run, block_emb, k_all, v_all))


def stacked_drafter_layers(cfg: DrafterConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> DrafterLayer:
    """All drafter layers as one `DrafterLayer` whose parameters carry a leading [num_layers] axis,
    each initialised with its own key: what `Drafter` scans over when `cfg.scan_layers`."""

    @nnx.split_rngs(splits=cfg.num_hidden_layers)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(r: nnx.Rngs) -> DrafterLayer:
        return DrafterLayer(cfg, dtype=dtype, rngs=r)

    return make(rngs)
