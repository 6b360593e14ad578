"""The naming rule: HF name minus a leading `model.` == our NNX state path joined by dots.

One twist: with scanned layers (`scan_layers=True`; unrolled is the default) the decoder layers are
stacked (`layers.<name>` holds every layer's `<name>` on a leading axis, so the forward scans them),
while checkpoints, HF's and ours alike, keep one tensor per layer (`layers.{i}.<name>`). `unstack_layers` / `stack_layers` convert between the two on
nested dicts; names are always checked and stored per layer.

`build_params` checks every tensor the model needs against the abstract model (names and shapes)
before anything is kept, so a wrong checkpoint fails with the offending name, not deep in XLA.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bastion_jax.checkpoints.errors import ConversionError
from bastion_jax.checkpoints.source import Source

# Buffers some checkpoints carry that our model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def path_to_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def name_to_path(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def is_stacked(tree: dict) -> bool:
    """Whether `tree["layers"]` holds stacked layers (named children) rather than one per index."""
    layers = tree.get("layers")
    return isinstance(layers, dict) and bool(layers) and not any(isinstance(k, int) for k in layers)


def unstack_layers(tree: dict) -> dict:
    """Stacked `layers` ([num_layers, ...] leaves, arrays or ShapeDtypeStructs) -> `layers[i]`, per
    layer as checkpoints store them; any other tree is returned as it is."""
    if not is_stacked(tree):
        return tree

    def row(a, i):
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a[i]

    n = jax.tree.leaves(tree["layers"])[0].shape[0]
    return {**tree, "layers": {i: jax.tree.map(lambda a: row(a, i), tree["layers"]) for i in range(n)}}


def stack_layers(tree: dict) -> dict:
    """Per-layer `layers[i]` -> stacked `layers` (the inverse of `unstack_layers`)."""
    layers = tree["layers"]
    rows = [layers[i] for i in range(len(layers))]
    return {**tree, "layers": jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a]), *rows)}


# The decoder layers' linear weights (`Linear(in_out=True)` holds them [in, out] on CPU).
_DENSE = {("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
          ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj")}


def swap_dense(tree: dict) -> dict:
    """The decoder layers' linear weights transposed (last two axes: per-layer [out, in] <-> [in, out],
    stacked [L, out, in] <-> [L, in, out]), everything else as it is: HF layout <-> `weights_in_out`,
    either way (its own inverse). Returns fresh dicts; arrays that do not move are shared."""
    def swap(layer: dict) -> dict:
        out = dict(layer)
        for block, proj in _DENSE:
            if block in out and proj in out[block]:
                out[block] = dict(out[block])
                w = out[block][proj]["weight"]
                if isinstance(w, jax.ShapeDtypeStruct):
                    w = jax.ShapeDtypeStruct((*w.shape[:-2], w.shape[-1], w.shape[-2]), w.dtype)
                else:
                    w = np.swapaxes(np.asarray(w), -1, -2) if isinstance(w, np.ndarray) else jnp.swapaxes(w, -1, -2)
                out[block][proj] = {**out[block][proj], "weight": w}
        return out

    layers = tree["layers"]
    if is_stacked(tree):
        return {**tree, "layers": swap(layers)}
    return {**tree, "layers": {i: swap(layer) for i, layer in layers.items()}}


def match_layout(params: dict, like: dict) -> dict:
    """`params` in the layer layout of `like` (a model's pure-dict state): stacked or per layer."""
    if is_stacked(like) and not is_stacked(params):
        return stack_layers(params)
    return unstack_layers(params) if is_stacked(params) and not is_stacked(like) else params


def expected_shapes(abstract_state: nnx.State) -> dict[str, tuple[int, ...]]:
    """Flat `name -> shape` for every parameter of an (abstract) model state, per layer."""
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(abstract_state))
    flat = jax.tree_util.tree_flatten_with_path(unstack_layers(shapes))[0]
    return {path_to_name(tuple(getattr(k, "key", k) for k in kp)): tuple(v.shape) for kp, v in flat}


def strip_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def build_params(source: Source, abstract_state: nnx.State, dtype: jnp.dtype) -> dict[str, Any]:
    """Load, validate and cast every tensor; returns a nested pure dict matching the model state."""
    expected = expected_shapes(abstract_state)
    available = {strip_prefix(n): n for n in source.names}
    missing = [n for n in expected if n not in available]
    if missing:
        raise ConversionError(
            f"missing tensor {missing[0]!r} in {source.path}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = [n for n in available if n not in expected and not n.endswith(_IGNORED_SUFFIXES)]
    if extra:
        print(f"checkpoint: ignoring {len(extra)} unused tensor(s), e.g. {extra[0]}",
              file=sys.stderr)
    nested: dict[str, Any] = {}
    for name, shape in expected.items():
        arr = source.load(available[name])
        if tuple(arr.shape) != shape:
            raise ConversionError(
                f"wrong shape for tensor {name!r} in {source.path}: expected {shape}, got {tuple(arr.shape)}")
        node = nested
        *parents, leaf = name_to_path(name)
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = np.asarray(arr).astype(dtype)  # cast one tensor at a time
    return match_layout(nested, nnx.to_pure_dict(abstract_state))
