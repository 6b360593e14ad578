"""Which layout of the target's layer weights, and which product form, XLA:CPU runs fastest here, measured once.

A verify step multiplies a few rows (the tree's nodes) by every weight matrix of the target, and
which XLA:CPU kernel does that, and how fast, depends on the weight's layout, on the product's form
and on the CPU. On one 2-core machine (2026-11-25) SmolLM2's layers ran a 4-token forward in 25 ms
with weights held [in, out] against 32 ms with HF's [out, in]; on another (an Intel Xeon with AMX,
2026-11-27) the same forward took 72 ms [in, out] against 62 ms [out, in] (8 tokens: 81 vs 72, 16:
91 vs 83; 1 token alike); on a third (an AVX2 AMD EPYC, 2026-11-28) the products alone took 45 ms
at 4 rows either way and 28 ms taken feature-major (`layers.project`: W @ x^T on the [out, in]
weights). A fixed choice costs some machine 10-40% of every tree step, so on CPU the layout is
measured: the target's own layer shapes (as many layers as fit in 1 GiB, enough to stream from
memory as the real model does), each of `LAYOUTS`, a 4- and a 16-row forward each, interleaved, the
fastest sum kept. The answer is cached per machine, JAX version, dtype and shapes under
`cache_root()/layout/`, so a machine measures once (a few seconds for SmolLM2 on 2 cores).
`$BASTION_WEIGHTS_LAYOUT` (`in-out`, `out-in`, `feature-major`, `auto`: the default) pins it. Models
whose layer weights fit in 64 MiB skip the probe: they sit in the CPU's caches, where the layout
hardly matters, and keep [in, out]. The feature-major form is a float32 one (`project`): other
dtypes choose between the two layouts.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from bastion_jax.config import ConfigError, TargetConfig
from bastion_jax.hardware import cpu_identity, cpu_name

ENV = "BASTION_WEIGHTS_LAYOUT"
# name -> (TargetConfig.weights_in_out, TargetConfig.feature_major)
LAYOUTS = {"in-out": (True, False), "out-in": (False, False), "feature-major": (False, True)}
PROBE_ROWS = (4, 16)  # tree sizes the controller verifies most (the AR step, 1 row, costs the same either way)
MIN_BYTES = 64 << 20  # below this the layer weights stay in cache: no probe
MAX_PROBE_BYTES = 1 << 30  # per layout: enough layers to stream from memory, not a 16 GB copy of an 8B model
ROUNDS = 5


def layer_shapes(cfg: TargetConfig) -> list[tuple[int, int]]:
    """[in, out] of a decoder layer's linear weights: q, k, v, o, gate, up, down."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def best_layout(cfg: TargetConfig, dtype: jnp.dtype | None = None) -> str:
    """Which of `LAYOUTS` this CPU multiplies a few rows by `cfg`'s layer weights fastest in."""
    forced = os.environ.get(ENV, "auto").strip().lower()
    if forced not in LAYOUTS and forced != "auto":
        raise ConfigError(f"${ENV} must be auto, {', '.join(LAYOUTS)}, got {forced!r}")
    dtype = jnp.dtype(dtype or jnp.float32)
    if forced in LAYOUTS:  # the feature-major form is float32's: other dtypes multiply [out, in] plainly
        return "out-in" if forced == "feature-major" and dtype != jnp.float32 else forced
    per_layer = sum(a * b for a, b in layer_shapes(cfg)) * dtype.itemsize
    if per_layer * cfg.num_hidden_layers < MIN_BYTES:
        return "in-out"
    layers = int(min(cfg.num_hidden_layers, max(1, MAX_PROBE_BYTES // per_layer)))
    path = _cache_path(cfg, dtype, layers)
    try:
        layout = json.loads(path.read_text())["layout"]
        if layout in LAYOUTS:
            return layout
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not measured yet on this machine (or an unreadable file): measure
    candidates = [k for k in LAYOUTS if dtype == jnp.float32 or not LAYOUTS[k][1]]
    ms = measure(layer_shapes(cfg), layers, dtype, layouts=candidates)
    layout = min(ms, key=lambda k: sum(ms[k].values()))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"layout": layout, "ms": ms, "layers": layers, "cpu": cpu_name(),
                                    "jax": jax.__version__, "dtype": dtype.name}, indent=1))
    except OSError:
        pass  # a read-only cache only costs the probe again next time
    return layout


def measure(shapes: list[tuple[int, int]], layers: int, dtype: jnp.dtype, rows=PROBE_ROWS,
            rounds: int = ROUNDS, layouts=tuple(LAYOUTS)) -> dict[str, dict[int, float]]:
    """Median ms of a `layers`-deep stack of these products at each row count, per layout, interleaved
    (the machine's speed drifts; every layout sees the same drift)."""
    stacks = {k: [[jnp.full(s if LAYOUTS[k][0] else s[::-1], 1e-3, dtype) for s in shapes]
                  for _ in range(layers)] for k in layouts}
    xs = {r: jnp.full((r, shapes[0][0]), 0.1, dtype) for r in rows}  # [rows, hidden]
    times: dict[tuple[str, int], list[float]] = {(k, r): [] for k in stacks for r in rows}
    for k in stacks:  # compile and warm
        for r in rows:
            jax.block_until_ready(_stack(xs[r], stacks[k], *LAYOUTS[k]))
    for _ in range(rounds):
        for r in rows:
            for k in stacks:
                t = time.perf_counter()
                jax.block_until_ready(_stack(xs[r], stacks[k], *LAYOUTS[k]))
                times[(k, r)].append(time.perf_counter() - t)
    return {k: {r: round(float(np.median(times[(k, r)])) * 1e3, 3) for r in rows} for k in stacks}


def _stack(x: jax.Array, weights: list[list[jax.Array]], in_out: bool, feature_major: bool) -> jax.Array:
    """The layers one call each (one small executable per layout and row count compiles in a fraction
    of a second; a whole unrolled stack took seconds), dispatched ahead, read once."""
    for w in weights:
        x = _layer(x, w, in_out, feature_major)
    return x


@partial(jax.jit, static_argnums=(2, 3))
def _layer(x: jax.Array, weights: list[jax.Array], in_out: bool, feature_major: bool) -> jax.Array:
    """A decoder layer's products with its data flow (q/k/v from x, o from q, gate/up, down), no attention."""
    from bastion_jax.modeling.layers import project

    spec = "...i,io->...o" if in_out else "...i,oi->...o"
    mm = partial(project, spec, feature_major=feature_major)
    q, k, v, o, gate, up, down = weights
    attn = mm(mm(x, q), o)  # [rows, hidden]
    x = x + 1e-3 * attn + 0 * (mm(x, k).sum() + mm(x, v).sum())
    return x + 1e-3 * mm(jax.nn.silu(mm(x, gate)) * mm(x, up), down)


def _cache_path(cfg: TargetConfig, dtype: jnp.dtype, layers: int):
    from bastion_jax.default_model import cache_root

    import jaxlib

    ident = json.dumps([*cpu_identity(), jax.__version__, jaxlib.__version__, dtype.name, layers,
                        layer_shapes(cfg), sorted(LAYOUTS)])  # a new candidate measures afresh
    return cache_root() / "layout" / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"
