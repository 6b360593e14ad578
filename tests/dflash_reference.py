"""Independent NumPy (float64) reference for one DFlash drafter forward pass.

Written from the spec (docs: bastion-dflash-spec.md, section A, esp. A.4), z-lab's
``dflash/model.py`` and HF Qwen3 / ``ACT2FN``; it deliberately imports nothing from ``bastion_jax``
so tests comparing against it are not circular.

Covered case: a single drafting call with an empty drafter cache (S_prev = 0). The context holds
the target features of *all* committed tokens at absolute positions 0..n_c-1 and the root token
sits at position s = n_c. Because context K/V of a position depend only on that position's feature
row and index (not on the block or on other context rows), this single call also equals any
multi-call sequence with a cache holding the same features (spec A.6).

Conventions (HF Qwen3 / z-lab ``dflash/model.py``, z-lab/dflash @ 44947fb):
  * RMSNorm(x; w, eps) = w * x / sqrt(mean(x**2, -1) + eps)
  * linear: y = x @ W.T (+ b), W stored [out, in]; q/k/v/o_proj carry a bias b iff
    ``attention_bias`` (HF Qwen3 attention), nothing else ever does (``fc``, Qwen3MLP)
  * MLP: down(act(gate(v)) * up(v)), act = HF ``ACT2FN[hidden_act]`` (silu/swish, gelu (erf),
    gelu_new / gelu_pytorch_tanh (tanh approximation), relu here; other names refused)
  * RoPE rotate-half: inv_freq_i = theta**(-2i/d), i < d/2; emb = concat(ang, ang);
    x*cos + rotate_half(x)*sin, rotate_half(x) = concat(-x[d/2:], x[:d/2])
  * GQA: query head j reads kv head j // (n_q // n_kv)
  * attention has NO mask (block is bidirectional and sees every context key); sliding-window
    layers are refused (see ``_check_supported``)

Context features (``reference_context_features``): z-lab ``extract_context_feature`` concatenates HF
``output_hidden_states[id + 1]`` over ``target_layer_ids``; HF's last entry is taken after the final
norm, so a tap on the target's last layer reads normed states.

Run ``python tests/dflash_reference.py`` for the self-checks.
"""

from __future__ import annotations

import math

import numpy as np

# ----------------------------------------------------------------------------------------------
# config helpers
# ----------------------------------------------------------------------------------------------


def _dflash_value(config: dict, name: str, default=None):
    """config['dflash_config'][name], else the top-level name, else default; refuses a conflicting pair.

    The order is SGLang's (``dflash_utils.resolve_dflash_block_size``: dflash_config first, then top
    level, a warning on conflict). z-lab's ``dflash/model.py`` reads ``block_size`` only at the top
    level and ``target_layer_ids`` / ``mask_token_id`` only in ``dflash_config``, so the two readers
    agree whenever at most one place is set or both agree; a conflicting pair has no single meaning.
    """
    sub = config.get("dflash_config") or {}
    inner, outer = sub.get(name), config.get(name)
    if inner is not None and outer is not None and inner != outer:
        raise NotImplementedError(f"{name} conflicts: top level {outer!r} vs dflash_config {inner!r}")
    if inner is not None:
        return inner
    return default if outer is None else outer


def _rope_theta(config: dict) -> float:
    if "rope_theta" in config and config["rope_theta"] is not None:
        return float(config["rope_theta"])
    params = config.get("rope_parameters") or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return 10000.0  # HF default


def _check_supported(config: dict) -> None:
    """Refuse configs whose semantics this reference does not implement (rather than be silently wrong)."""
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise NotImplementedError(f"reference implements default RoPE only, got rope_scaling={scaling}")
    params = config.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise NotImplementedError(f"reference implements default RoPE only, got rope_parameters={params}")
    if config.get("hidden_act", "silu") not in _ACTS:
        raise NotImplementedError(f"hidden_act={config['hidden_act']!r} not implemented")
    # Knobs that would change the math if some reader honoured them. z-lab's dflash/model.py reads
    # none of them; the reference refuses them rather than silently ignore them.
    if float(_dflash_value(config, "input_embedding_scale", 1.0)) != 1.0:
        raise NotImplementedError("input_embedding_scale != 1 not implemented")
    if float(_dflash_value(config, "output_multiplier", 1.0)) != 1.0:
        raise NotImplementedError("output_multiplier != 1 not implemented")
    if _dflash_value(config, "final_logit_softcapping") not in (None, 0, 0.0):
        raise NotImplementedError("final_logit_softcapping not implemented")
    # z-lab passes `sliding_window` of a "sliding_attention" layer to the attention kernel with no mask:
    # flash-attention applies a symmetric |i - j| < window band, SDPA/eager ignore it; SGLang makes such
    # layers causal. No single semantics, so neither is implemented here.
    use_sw = config.get("use_sliding_window", False)
    types = config.get("layer_types") or [
        "sliding_attention" if use_sw and config.get("sliding_window", 4096) is not None
        and i >= config.get("max_window_layers", 28) else "full_attention"
        for i in range(int(config["num_hidden_layers"]))]
    if _dflash_value(config, "is_causal") or "sliding_attention" in types:
        raise NotImplementedError("causal / sliding-window drafter attention not implemented")


# ----------------------------------------------------------------------------------------------
# primitives (float64)
# ----------------------------------------------------------------------------------------------


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # x [..., D], w [D]  ->  [..., D]
    var = np.mean(x * x, axis=-1, keepdims=True)
    return w * (x / np.sqrt(var + eps))


def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    # x [..., in], w [out, in], b [out] or None  ->  [..., out]
    return x @ w.T if b is None else x @ w.T + b


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


_erf = np.vectorize(math.erf, otypes=[np.float64])

# HF ACT2FN semantics (transformers/activations.py), written out in float64.
_ACTS = {
    "silu": _silu,
    "swish": _silu,
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),                     # GELUActivation (erf)
    "gelu_new": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
    "gelu_pytorch_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
    "relu": lambda x: np.maximum(x, 0.0),
}


def _rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    # positions [n] -> cos, sin [n, head_dim]
    half = head_dim // 2
    i = np.arange(half, dtype=np.float64)
    inv_freq = theta ** (-2.0 * i / head_dim)                       # [d/2]
    angles = positions.astype(np.float64)[:, None] * inv_freq[None]  # [n, d/2]
    emb = np.concatenate([angles, angles], axis=-1)                  # [n, d]
    return np.cos(emb), np.sin(emb)


def _rotate_half(x: np.ndarray) -> np.ndarray:
    # x [..., d] -> concat(-x[d/2:], x[:d/2])
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # x [n, d] (one head), cos/sin [n, d]
    return x * cos + _rotate_half(x) * sin


def _softmax(x: np.ndarray) -> np.ndarray:
    # over the last axis
    z = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(z)
    return e / np.sum(e, axis=-1, keepdims=True)


# ----------------------------------------------------------------------------------------------
# forward pass (loop version)
# ----------------------------------------------------------------------------------------------


def reference_draft_hidden(weights: dict[str, np.ndarray], config: dict, noise_embedding: np.ndarray,
                           context_features: np.ndarray, context_positions: np.ndarray,
                           block_positions: np.ndarray) -> np.ndarray:
    """Final-normed drafter hidden states for the B block slots, float64 [B, H].

    General-position form of spec A.4 (used by `reference_draft_logits`; exposed so tests can place
    context rows at arbitrary absolute positions):
      noise_embedding   [B, H]        embedded block tokens (target embed, unscaled)
      context_features  [n_c, T*H]    target features (T taps concatenated in target_layer_ids order)
      context_positions [n_c]         RoPE position of each context row (its key position)
      block_positions   [B]           RoPE positions of the block slots (query and block-key positions)
    """
    _check_supported(config)
    H = int(config["hidden_size"])
    n_layers = int(config["num_hidden_layers"])
    n_q = int(config["num_attention_heads"])
    n_kv = int(config["num_key_value_heads"])
    d = int(config.get("head_dim") or H // n_q)
    eps = float(config["rms_norm_eps"])
    theta = _rope_theta(config)
    assert n_q % n_kv == 0, (n_q, n_kv)
    group = n_q // n_kv
    act = _ACTS[config.get("hidden_act", "silu")]
    W = {k: _f64(v) for k, v in weights.items()}
    bias = bool(config.get("attention_bias", False))

    def proj(x, name):  # a q/k/v/o projection, with its bias iff attention_bias
        return _linear(x, W[name + ".weight"], W[name + ".bias"] if bias else None)

    h = _f64(noise_embedding)              # [B, H]
    feats = _f64(context_features)         # [n_c, T*H]
    B = h.shape[0]
    n_c = feats.shape[0]
    assert h.shape == (B, H), h.shape
    assert W["fc.weight"].shape == (H, feats.shape[1]), (W["fc.weight"].shape, feats.shape)
    ctx_pos = np.asarray(context_positions)
    blk_pos = np.asarray(block_positions)
    assert ctx_pos.shape == (n_c,) and blk_pos.shape == (B,)

    # 1. context projection, shared by all layers (no input_layernorm on it)
    x_ctx = _rms_norm(_linear(feats, W["fc.weight"]), W["hidden_norm.weight"], eps)   # [n_c, H]

    # 2. RoPE tables
    key_pos = np.concatenate([ctx_pos, blk_pos])                   # [n_c + B]
    cos_k, sin_k = _rope_cos_sin(key_pos, d, theta)                # [n_c + B, d]
    cos_q, sin_q = _rope_cos_sin(blk_pos, d, theta)                # [B, d]  (= last B rows of the key table)

    # 3. layers
    for layer in range(n_layers):
        p = f"layers.{layer}."
        u = _rms_norm(h, W[p + "input_layernorm.weight"], eps)                  # [B, H]

        q_all = proj(u, p + "self_attn.q_proj")                                  # [B, n_q*d]
        k_all = np.concatenate([proj(x_ctx, p + "self_attn.k_proj"),
                                proj(u, p + "self_attn.k_proj")], axis=0)        # [n_c+B, n_kv*d]
        v_all = np.concatenate([proj(x_ctx, p + "self_attn.v_proj"),
                                proj(u, p + "self_attn.v_proj")], axis=0)        # [n_c+B, n_kv*d]

        # keys / values per kv head: k_norm before RoPE, V untouched
        keys, values = [], []
        for g in range(n_kv):
            k_g = k_all[:, g * d:(g + 1) * d]                                     # [n_c+B, d]
            k_g = _rms_norm(k_g, W[p + "self_attn.k_norm.weight"], eps)
            keys.append(_apply_rope(k_g, cos_k, sin_k))
            values.append(v_all[:, g * d:(g + 1) * d])                            # [n_c+B, d]

        head_outputs = []
        for j in range(n_q):
            q_j = q_all[:, j * d:(j + 1) * d]                                     # [B, d]
            q_j = _rms_norm(q_j, W[p + "self_attn.q_norm.weight"], eps)
            q_j = _apply_rope(q_j, cos_q, sin_q)
            g = j // group
            scores = (q_j @ keys[g].T) / np.sqrt(d)                               # [B, n_c+B], no mask
            probs = _softmax(scores)
            head_outputs.append(probs @ values[g])                                # [B, d]
        attn = np.concatenate(head_outputs, axis=-1)                              # [B, n_q*d]
        h = h + proj(attn, p + "self_attn.o_proj")                                # [B, H]

        v = _rms_norm(h, W[p + "post_attention_layernorm.weight"], eps)           # [B, H]
        gate = _linear(v, W[p + "mlp.gate_proj.weight"])                          # [B, I]
        up = _linear(v, W[p + "mlp.up_proj.weight"])                              # [B, I]
        h = h + _linear(act(gate) * up, W[p + "mlp.down_proj.weight"])            # [B, H]

    # 4. final norm
    return _rms_norm(h, W["norm.weight"], eps)                                    # [B, H]


def reference_draft_logits(weights: dict[str, np.ndarray], config: dict, target_embed: np.ndarray,
                           target_lm_head: np.ndarray, context_features: np.ndarray,
                           root_token: int) -> np.ndarray:
    """Draft logits [block_size - 1, V] (float64) for block slots 1..B-1 of one drafting call.

    context_features [n_c, n_taps*H] are the target features of all committed tokens at positions
    0..n_c-1; the root token sits at s = n_c; the block [root, mask x (B-1)] occupies s..s+B-1.
    Slot k (1 <= k <= B-1) predicts the token at position s+k.
    """
    B = int(_dflash_value(config, "block_size", 16))
    mask_id = int(_dflash_value(config, "mask_token_id"))
    embed = _f64(target_embed)                    # [V, H]
    head = _f64(target_lm_head)                   # [V, H]
    V = embed.shape[0]
    assert 0 <= root_token < V and 0 <= mask_id < V, (root_token, mask_id, V)
    n_c = np.asarray(context_features).shape[0]
    assert n_c >= 1
    s = n_c

    block_ids = np.array([root_token] + [mask_id] * (B - 1))                     # [B]
    noise = embed[block_ids]                                                      # [B, H], unscaled
    hidden = reference_draft_hidden(weights, config, noise, context_features,
                                    context_positions=np.arange(0, s),
                                    block_positions=np.arange(s, s + B))         # [B, H]
    return _linear(hidden[1:], head)                                              # [B-1, V]


def reference_context_features(hidden_states, layer_ids) -> np.ndarray:
    """z-lab ``extract_context_feature``: concat of ``hidden_states[id + 1]`` over ``layer_ids``.

    ``hidden_states`` is HF's ``output_hidden_states`` tuple (index 0 = embeddings, index L = the last
    layer's output after the final norm), each [..., T, H]; returns [..., T, len(layer_ids) * H].
    """
    return np.concatenate([_f64(hidden_states[i + 1]) for i in layer_ids], axis=-1)


# ----------------------------------------------------------------------------------------------
# random tiny drafter
# ----------------------------------------------------------------------------------------------


def _build_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    # spec A.3 (z-lab build_target_layer_ids)
    if n == 1:
        return [num_target_layers // 2]
    return [int(round(1 + i * (num_target_layers - 4) / (n - 1))) for i in range(n)]


def random_zlab_drafter(rng: np.random.Generator, *, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8,
                        intermediate=64, n_taps=2, vocab=50, block_size=4, mask_token_id=49,
                        theta=10000.0, attention_bias=False, hidden_act="silu") -> tuple[dict, dict]:
    """(config, weights) of a random z-lab-format drafter (weights float32, keys without `model.`);
    with `attention_bias` each q/k/v/o_proj also gets a random `.bias`."""
    num_target_layers = max(8, 2 * n_taps + 4)
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "hidden_act": hidden_act,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": theta,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "attention_bias": attention_bias,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "block_size": block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": _build_target_layer_ids(num_target_layers, n_taps),
        },
    }

    def mat(out_dim, in_dim):
        return (0.1 * rng.standard_normal((out_dim, in_dim))).astype(np.float32)

    def norm(dim):
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    weights = {
        "fc.weight": mat(hidden, n_taps * hidden),
        "hidden_norm.weight": norm(hidden),
        "norm.weight": norm(hidden),
    }
    for i in range(layers):
        p = f"layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        weights[p + "self_attn.q_proj.weight"] = mat(heads * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = mat(kv_heads * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = mat(kv_heads * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = mat(hidden, heads * head_dim)
        weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
        weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        weights[p + "mlp.gate_proj.weight"] = mat(intermediate, hidden)
        weights[p + "mlp.up_proj.weight"] = mat(intermediate, hidden)
        weights[p + "mlp.down_proj.weight"] = mat(hidden, intermediate)
        if attention_bias:
            for name, dim in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim),
                              ("o", hidden)):
                weights[p + f"self_attn.{name}_proj.bias"] = (0.3 * rng.standard_normal(dim)).astype(np.float32)
    return config, weights


# ----------------------------------------------------------------------------------------------
# self-checks
# ----------------------------------------------------------------------------------------------


def _vectorised_draft_hidden(weights, config, noise_embedding, context_features, context_positions,
                             block_positions):
    """Second, differently structured computation: batched einsums over heads, GQA via np.repeat,
    RoPE as complex multiplication of (x[:d/2] + i x[d/2:]) by exp(i*angle), logsumexp softmax."""
    W = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    H, L = config["hidden_size"], config["num_hidden_layers"]
    nq, nkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    eps = config["rms_norm_eps"]
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    zero = np.zeros(1)

    def b(name):  # bias or 0 (attention_bias absent -> no bias keys at all)
        return W.get(name + ".bias", zero) if config.get("attention_bias") else zero

    def sig(z):
        return 0.5 + 0.5 * np.tanh(0.5 * z)

    c = math.sqrt(2.0 / math.pi)
    act = {  # same functions as _ACTS, written differently (sigmoid / erfc forms)
        "silu": lambda g: g * sig(g), "swish": lambda g: g * sig(g),
        "gelu": lambda g: 0.5 * g * np.vectorize(math.erfc)(-g / math.sqrt(2.0)),
        "gelu_new": lambda g: g * sig(2 * c * (g + 0.044715 * g ** 3)),
        "gelu_pytorch_tanh": lambda g: g * sig(2 * c * (g + 0.044715 * g ** 3)),
        "relu": lambda g: g * (g > 0),
    }[config.get("hidden_act", "silu")]

    def rms(x, w):
        return w * x * (np.mean(x ** 2, axis=-1, keepdims=True) + eps) ** -0.5

    def rope(x, pos):  # x [..., n, heads, d]
        ang = np.outer(np.asarray(pos, np.float64), 1.0 / theta ** (np.arange(0, d, 2) / d))  # [n, d/2]
        z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * np.exp(1j * ang)[:, None, :]
        return np.concatenate([z.real, z.imag], axis=-1)

    h = np.asarray(noise_embedding, np.float64)
    B = h.shape[0]
    xc = rms(np.einsum("nf,hf->nh", np.asarray(context_features, np.float64), W["fc.weight"]), W["hidden_norm.weight"])
    kpos = np.concatenate([context_positions, block_positions])
    for i in range(L):
        p = f"layers.{i}."
        u = rms(h, W[p + "input_layernorm.weight"])
        both = np.concatenate([xc, u], axis=0)                                     # [n_c+B, H]
        a = p + "self_attn."
        q = (np.einsum("bh,oh->bo", u, W[a + "q_proj.weight"]) + b(a + "q_proj")).reshape(B, nq, d)
        k = (np.einsum("th,oh->to", both, W[a + "k_proj.weight"]) + b(a + "k_proj")).reshape(-1, nkv, d)
        v = (np.einsum("th,oh->to", both, W[a + "v_proj.weight"]) + b(a + "v_proj")).reshape(-1, nkv, d)
        q = rope(rms(q, W[p + "self_attn.q_norm.weight"]), block_positions)
        k = rope(rms(k, W[p + "self_attn.k_norm.weight"]), kpos)
        k = np.repeat(k, nq // nkv, axis=1)                                        # [T, nq, d]
        v = np.repeat(v, nq // nkv, axis=1)
        s = np.einsum("bnd,tnd->nbt", q, k) / np.sqrt(d)
        m = s.max(-1, keepdims=True)
        lse = m + np.log(np.exp(s - m).sum(-1, keepdims=True))
        o = np.einsum("nbt,tnd->bnd", np.exp(s - lse), v).reshape(B, nq * d)
        h = h + o @ W[p + "self_attn.o_proj.weight"].T + b(p + "self_attn.o_proj")
        vv = rms(h, W[p + "post_attention_layernorm.weight"])
        g = vv @ W[p + "mlp.gate_proj.weight"].T
        h = h + (act(g) * (vv @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    return rms(h, W["norm.weight"])


def _self_check() -> None:
    rng = np.random.default_rng(0)
    cases = [
        dict(),
        dict(hidden=48, layers=3, heads=6, kv_heads=3, head_dim=16, intermediate=40, n_taps=3, vocab=70,
             block_size=5, mask_token_id=3, theta=1e6),
        dict(heads=4, kv_heads=4, n_taps=1, block_size=2),   # MHA, single tap, one draft slot
        dict(heads=8, kv_heads=1, head_dim=4, block_size=16),  # MQA
        dict(attention_bias=True, hidden_act="gelu"),
        dict(attention_bias=True, hidden_act="gelu_pytorch_tanh", kv_heads=1),
        dict(hidden_act="relu"),
    ]
    for kw in cases:
        config, weights = random_zlab_drafter(rng, **kw)
        H, V, B = config["hidden_size"], config["vocab_size"], config["block_size"]
        n_taps = len(config["dflash_config"]["target_layer_ids"])
        embed = rng.standard_normal((V, H)).astype(np.float32)
        lm_head = (0.2 * rng.standard_normal((V, H))).astype(np.float32)
        for n_c in (1, 3, 11):
            feats = rng.standard_normal((n_c, n_taps * H)).astype(np.float32)
            root = int(rng.integers(V))

            # shapes / dtype / finiteness
            logits = reference_draft_logits(weights, config, embed, lm_head, feats, root)
            assert logits.shape == (B - 1, V) and logits.dtype == np.float64, (logits.shape, logits.dtype)
            assert np.all(np.isfinite(logits))

            # agreement with the vectorised einsum/complex-RoPE implementation
            ids = np.array([root] + [config["dflash_config"]["mask_token_id"]] * (B - 1))
            hid2 = _vectorised_draft_hidden(weights, config, embed[ids], feats, np.arange(n_c), np.arange(n_c, n_c + B))
            logits2 = hid2[1:] @ lm_head.astype(np.float64).T
            err = np.max(np.abs(logits - logits2))
            assert err < 1e-10, err

            # no mask: permuting context rows together with their positions changes nothing
            perm = rng.permutation(n_c)
            noise = embed[ids]
            base = reference_draft_hidden(weights, config, noise, feats, np.arange(n_c), np.arange(n_c, n_c + B))
            permuted = reference_draft_hidden(weights, config, noise, feats[perm], perm, np.arange(n_c, n_c + B))
            assert np.max(np.abs(base - permuted)) < 1e-12
            # ...while permuting rows at fixed positions changes the output (only through RoPE)
            if n_c > 1:
                perm = np.roll(np.arange(n_c), 1)
                moved = reference_draft_hidden(weights, config, noise, feats[perm], np.arange(n_c), np.arange(n_c, n_c + B))
                assert np.max(np.abs(base - moved)) > 1e-6
                # with all angles zero (every position 0) RoPE is the identity -> order irrelevant
                z_ctx, z_blk = np.zeros(n_c, int), np.zeros(B, int)
                a = reference_draft_hidden(weights, config, noise, feats, z_ctx, z_blk)
                b = reference_draft_hidden(weights, config, noise, feats[perm], z_ctx, z_blk)
                assert np.max(np.abs(a - b)) < 1e-12

            # shifting every position by the same offset leaves q.k (hence output) unchanged (relative RoPE)
            shifted = reference_draft_hidden(weights, config, noise, feats, np.arange(n_c) + 7, np.arange(n_c, n_c + B) + 7)
            assert np.max(np.abs(base - shifted)) < 1e-9

            # bidirectional block: the root slot output depends on later mask slots (changing a mask
            # slot's embedding changes slot 0), i.e. there is no causal mask
            noise_b = noise.copy()
            noise_b[-1] += 1.0
            other = reference_draft_hidden(weights, config, noise_b, feats, np.arange(n_c), np.arange(n_c, n_c + B))
            assert np.max(np.abs(other[0] - base[0])) > 1e-6

            # the root token matters; the lm_head is applied to slots 1..B-1 only
            root2 = (root + 1) % V
            logits_r2 = reference_draft_logits(weights, config, embed, lm_head, feats, root2)
            assert np.max(np.abs(logits - logits_r2)) > 1e-6
            assert np.allclose(logits, base[1:] @ lm_head.astype(np.float64).T, rtol=0, atol=1e-12)

    # rope_parameters.rope_theta form of the config gives the same result
    config, weights = random_zlab_drafter(rng, theta=500.0)
    alt = {k: v for k, v in config.items() if k != "rope_theta"}
    alt["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    embed = rng.standard_normal((50, 32))
    head = rng.standard_normal((50, 32))
    feats = rng.standard_normal((5, 64))
    assert np.array_equal(reference_draft_logits(weights, config, embed, head, feats, 7),
                          reference_draft_logits(weights, alt, embed, head, feats, 7))
    # attention biases and the activation really enter the output
    config, weights = random_zlab_drafter(rng, attention_bias=True, hidden_act="gelu")
    embed, head = rng.standard_normal((50, 32)), rng.standard_normal((50, 32))
    feats = rng.standard_normal((5, 64))
    base = reference_draft_logits(weights, config, embed, head, feats, 7)
    for name in ("q", "k", "v", "o"):
        w2 = dict(weights)
        w2[f"layers.0.self_attn.{name}_proj.bias"] = 0 * w2[f"layers.0.self_attn.{name}_proj.bias"]
        assert np.max(np.abs(reference_draft_logits(w2, config, embed, head, feats, 7) - base)) > 1e-6, name
    for other in ("silu", "gelu_new", "relu"):
        moved = reference_draft_logits(weights, dict(config, hidden_act=other), embed, head, feats, 7)
        assert np.max(np.abs(moved - base)) > 1e-6, other

    # block_size in either place; a conflicting pair and sliding layers are refused
    top = dict(config, block_size=4)
    nested = {k: v for k, v in top.items() if k != "block_size"}
    nested["dflash_config"] = dict(config["dflash_config"], block_size=4)
    assert np.array_equal(reference_draft_logits(weights, top, embed, head, feats, 7),
                          reference_draft_logits(weights, nested, embed, head, feats, 7))
    for bad in (dict(nested, block_size=5), dict(config, layer_types=["sliding_attention", "full_attention"]),
                dict(config, layer_types=None, use_sliding_window=True, sliding_window=8, max_window_layers=1)):
        try:
            reference_draft_logits(weights, bad, embed, head, feats, 7)
        except NotImplementedError:
            continue
        raise AssertionError(f"not refused: {bad}")
    print("dflash_reference self-check OK")


if __name__ == "__main__":
    _self_check()
