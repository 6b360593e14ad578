"""Building blocks shared by the target decoder and the DFlash drafter.

Parameters are stored in Hugging Face layout (`weight` of a linear layer is `[out, in]`) so that
checkpoint conversion is a pure rename; XLA folds the transpose into the matmul. The one exception
is `Linear(in_out=True)` (the target's layers on CPU), transposed at load and back at save.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bastion_jax.config import RopeConfig

_INIT = nnx.initializers.normal(stddev=0.02)
# `project(feature_major=True)` takes the W @ x^T form up to this many rows (a verify step's tree, a
# drafter's block, a short prompt), the plain one above (a long prefill: see `project`).
FEATURE_MAJOR_MAX_ROWS = 64


def project(spec: str, x: jax.Array, w: jax.Array, out_dtype: jnp.dtype | None = None, *,
            feature_major: bool = False) -> jax.Array:
    """`einsum(spec, x, w)` for a weight matrix `w`, in `w`'s dtype, the result in `out_dtype` (default
    `w`'s dtype; float32 for logits: accumulated in float32, not just returned in it).

    bf16 on CPU takes XLA:CPU's fast kernel: a bf16 x bf16 -> f32 dot runs as a YNNPACK fusion, but
    one with a bf16 result (SmolLM2's 30 layers at 4 rows: 137 vs 13 ms) or a single row (117 vs 12
    ms) fell back to converting the whole weight matrix to float32 every step. So there the product
    is accumulated in float32 and rounded once (as torch does in bf16), and a lone row is padded to
    two. float32 weights and other backends take the plain einsum, as before. `spec` contracts x's last
    axis into one output axis, leading axes kept (`"...i,io->...o"`, `"...h,vh->...v"`): the padding
    reshapes x to [rows, in] and back.

    `feature_major` (float32 on CPU, `w` held [out, in]: `"...i,oi->...o"`, `"...h,vh->...v"`): the product is
    taken as w @ x^T, [out, in] @ [in, rows] -> [out, rows], and transposed back. Same sum, another
    XLA:CPU kernel: Eigen's micro-kernel tiles the output's rows 24 at a time and its columns 4 at a
    time (AVX2), so a verify step's few rows fill it only as columns. On a 2-core AMD EPYC (AVX2,
    2026-11-28) SmolLM2's 30 layers of products at 4 / 16 rows took 28 / 40 ms this way against 45 /
    62 ms as x @ w ([in, out] or [out, in] alike; 1 row alike). The transposes are real copies of
    the few rows (`optimization_barrier`): left as transposes, XLA folds them back into the slow
    dot. Which form a machine runs faster is measured (`checkpoints.layout_probe`). Only up to
    `FEATURE_MAJOR_MAX_ROWS` rows: from 128 rows on (a prefill) the plain product was the faster one
    there (128 / 256 / 1,024 rows: 210 / 375 / 1,441 ms against 191 / 351 / 1,295; 64: 110 vs 117)."""
    out_dtype = jnp.dtype(w.dtype if out_dtype is None else out_dtype)
    x = x.astype(w.dtype)
    lead = x.shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    if feature_major and w.dtype == jnp.float32 and jax.default_backend() == "cpu" and rows <= FEATURE_MAJOR_MAX_ROWS:
        xt = jax.lax.optimization_barrier(x.reshape(-1, x.shape[-1]).T)  # [in, rows]
        y = jnp.dot(w, xt, preferred_element_type=out_dtype)  # [out, rows]
        return jax.lax.optimization_barrier(y).T.reshape(lead + w.shape[:1])
    if w.dtype == jnp.float32 or jax.default_backend() != "cpu":
        return jnp.einsum(spec, x, w, **({} if out_dtype == w.dtype else {"preferred_element_type": out_dtype}))
    if rows == 1:  # [1, in] -> [2, in]: a zero row, dropped again below
        x = jnp.concatenate([x.reshape(1, x.shape[-1]), jnp.zeros((1, x.shape[-1]), x.dtype)])
    y = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(out_dtype)
    return y[:1].reshape(lead + y.shape[-1:]) if rows == 1 else y


class Linear(nnx.Module):
    """`y = x W^T + b` with `W` stored `[out_features, in_features]` like `torch.nn.Linear`, or, with
    `in_out`, stored `[in_features, out_features]`: on some CPUs XLA multiplies a few rows (a verify
    step's tree) by an [in, out] matrix faster than by an [out, in] one; on others the
    `feature_major` product (`project`) of the [out, in] matrix is the fastest. The target's layers
    on CPU take whichever the machine runs fastest (`TargetConfig.weights_in_out` / `feature_major`,
    measured by `checkpoints.layout_probe`); checkpoints stay in HF layout (`checkpoints.params`)."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
                 dtype: jnp.dtype = jnp.float32, in_out: bool = False, feature_major: bool = False,
                 rngs: nnx.Rngs):
        if in_out and feature_major:
            raise ValueError("Linear: feature_major products take the [out, in] layout, not in_out")
        shape = (in_features, out_features) if in_out else (out_features, in_features)
        self.weight = nnx.Param(_INIT(rngs.params(), shape, dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None
        self.in_out = in_out  # static: part of the graph definition
        self.feature_major = feature_major  # static too

    def __call__(self, x: jax.Array) -> jax.Array:
        y = project("...i,io->...o" if self.in_out else "...i,oi->...o", x, self.weight[...],
                    feature_major=self.feature_major)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embedding(nnx.Module):
    """Token embedding `[vocab, hidden]`; `attend` reuses it as a tied LM head."""

    def __init__(self, num_embeddings: int, features: int, *, dtype: jnp.dtype = jnp.float32,
                 rngs: nnx.Rngs):
        self.weight = nnx.Param(_INIT(rngs.params(), (num_embeddings, features), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)

    def attend(self, x: jax.Array, feature_major: bool = False) -> jax.Array:
        return project("...h,vh->...v", x, self.weight[...], feature_major=feature_major)


class RMSNorm(nnx.Module):
    """HF Llama/Qwen3 RMSNorm: normalise in fp32, cast back, then scale (order matters in bf16)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype = jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        xf = x.astype(jnp.float32)
        ms = ordered_mean(xf * xf) if row_exact(x.dtype) else jnp.mean(xf * xf, axis=-1, keepdims=True)
        xf = xf * jax.lax.rsqrt(ms + self.eps)
        return w * xf.astype(x.dtype)


def row_exact(dtype: jnp.dtype) -> bool:
    """Whether a step's sums must come out bit for bit the same for a row whatever rows share the
    step: a 16-bit float model on CPU. There every activation is rounded, so a sum taken in another
    order (XLA:CPU vectorises a reduction by the shape around it) becomes, now and then, another
    rounded value, and a token verified in a tree step gets other logits than the AR step that
    would have produced it (`attention.attend_canonical`). float32 keeps such differences at ~1e-6
    of a logit, below any argmax; other backends' products are not row-independent anyway."""
    dtype = jnp.dtype(dtype)
    return dtype.itemsize < 4 and jnp.issubdtype(dtype, jnp.floating) and jax.default_backend() == "cpu"


def ordered_mean(x: jax.Array, lanes: int = 16) -> jax.Array:
    """mean(x, axis=-1, keepdims=True) of a float32 x summed in one fixed order whatever the leading
    shape: `lanes` running sums over the axis in steps of `lanes`, then halved pairwise. Elementwise
    adds only, which XLA neither reorders nor vectorises by the shape (a `reduce` gave a row of a
    16-row step another sum than the same row alone 22% of the time on SmolLM2's 576 features)."""
    h = x.shape[-1]
    if h % lanes:
        x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (lanes - h % lanes,), x.dtype)], axis=-1)
    x = x.reshape(x.shape[:-1] + (-1, lanes))  # [..., h / lanes, lanes]
    acc = x[..., 0, :]
    for i in range(1, x.shape[-2]):
        acc = acc + x[..., i, :]
    while lanes > 1:
        lanes //= 2
        acc = acc[..., :lanes] + acc[..., lanes:2 * lanes]
    return acc / h  # [..., 1]


# HF `ACT2FN` names -> the same function: "gelu" is the exact erf form, "gelu_new" and
# "gelu_pytorch_tanh" the tanh approximation, "swish" is silu. Keys == dflash_config.DRAFTER_ACTIVATIONS.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu, "swish": jax.nn.silu,
    "gelu": partial(jax.nn.gelu, approximate=False),
    "gelu_new": partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
}


class MLP(nnx.Module):
    """Gated feed-forward down(act(gate(x)) * up(x)) as HF's Llama/Qwen3 MLP; act = silu is SwiGLU."""

    def __init__(self, hidden: int, intermediate: int, *, use_bias: bool = False, act: str = "silu",
                 dtype: jnp.dtype = jnp.float32, in_out: bool = False, feature_major: bool = False,
                 rngs: nnx.Rngs):
        kw = dict(use_bias=use_bias, dtype=dtype, in_out=in_out, feature_major=feature_major, rngs=rngs)
        self.gate_proj = Linear(hidden, intermediate, **kw)
        self.up_proj = Linear(hidden, intermediate, **kw)
        self.down_proj = Linear(intermediate, hidden, **kw)
        self.act = act  # a name (static, hashable), looked up in ACTIVATIONS

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies `[head_dim // 2]` in fp32, as HF computes them (incl. llama3 scaling)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (rope.theta ** exponents)).astype(np.float32)
    if rope.rope_type == "default":
        return inv_freq
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(inv_freq: np.ndarray, positions: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables `[batch, seq, head_dim]` for integer positions `[batch, seq]`."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [b, t, d/2]
    emb = jnp.concatenate([angles, angles], axis=-1)  # [b, t, d]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on `x` `[batch, seq, heads, head_dim]` (HF convention)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
