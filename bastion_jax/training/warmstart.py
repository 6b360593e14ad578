"""Start a drafter from the target's top layers instead of random weights (`--init-from-target`), or
deepen a trained drafter or widen what it reads of the target without losing what it learnt (`grow`:
`--init DIR --layers N`; `widen_taps`: `--init DIR --num-taps N`).

A DFlash drafter layer has the shape of a target layer (same width, heads and, by default, MLP
width), and its input lives where the target's last layers work: it feeds the target's LM head.
Copying the last L target layers gives the drafter a language model's attention and MLP weights
to adapt instead of noise to shape. Only `fc` (which fuses the tapped features) and its
`hidden_norm` keep their fresh initialisation; q_norm/k_norm are copied only from a target that has
them (Qwen3), else they stay at 1. The drafter's final norm takes the target's final norm, the one
in front of the LM head the drafter shares.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from bastion_jax.checkpoints import LoadedDrafter, Target, random_drafter
from bastion_jax.checkpoints.params import swap_dense, unstack_layers
from bastion_jax.dflash_config import default_target_layer_ids


def init_from_target(drafter: LoadedDrafter, target: Target) -> LoadedDrafter:
    """A copy of `drafter` whose layer i holds target layer (n - L + i)'s weights and whose final norm is
    the target's; raises ValueError when a copied weight's shape differs (e.g. another MLP width)."""
    n, layers = target.config.num_hidden_layers, drafter.config.num_hidden_layers
    if layers > n:
        raise ValueError(f"--init-from-target: the drafter has {layers} layers, the target only {n}")
    src = unstack_layers(nnx.to_pure_dict(target.state))  # fresh nested dicts, per layer
    if target.config.weights_in_out:  # the drafter's layers keep HF's [out, in]
        src = swap_dense(src)
    dst = nnx.to_pure_dict(drafter.state)

    def copy(d_tree: dict, t_tree: dict, what: str) -> None:
        """Every leaf of `t_tree` that `d_tree` also has (a drafter without biases skips a target's)."""
        for name, t_leaf in t_tree.items():
            if isinstance(t_leaf, dict):
                if isinstance(d_tree.get(name), dict):
                    copy(d_tree[name], t_leaf, f"{what}.{name}")
                continue
            if name not in d_tree:
                continue
            d_leaf = d_tree[name]
            if tuple(d_leaf.shape) != tuple(t_leaf.shape):
                raise ValueError(f"--init-from-target: {what}.{name} is {tuple(t_leaf.shape)} in the target but "
                                 f"{tuple(d_leaf.shape)} in the drafter (use the target's sizes, e.g. "
                                 f"--intermediate-size {target.config.intermediate_size})")
            d_tree[name] = jnp.asarray(t_leaf, d_leaf.dtype)

    for i in range(layers):  # norms, q/k/v/o (+ q/k norms, biases) and the MLP of each layer
        copy(dst["layers"][i], src["layers"][n - layers + i], f"layers.{n - layers + i}")
    copy(dst["norm"], src["norm"], "norm")
    state = jax.tree.map(lambda a: a, drafter.state)  # a new State: the given drafter stays as it was
    nnx.replace_by_pure_dict(state, dst)
    return dataclasses.replace(drafter, state=state)


def grow(drafter: LoadedDrafter, layers: int) -> LoadedDrafter:
    """`drafter` deepened to `layers` layers: its own layers first, then copies of its last layer with
    `o_proj` and `down_proj` (and their biases) zeroed, so each new layer adds nothing to the residual
    stream and the deeper drafter drafts exactly as the given one until training moves them.

    Why not fresh layers: a 4-layer drafter started from the target's top layers reached a held-out
    accept length of 1.52 in 766 H100 steps, where the trained 2-layer one continued from 2.25 to 2.34
    (`benchmarks/results/h100-2026-11-26-lease2.md`); a lease is too short to catch up from scratch.
    Copies rather than random weights, so the new attention and MLP start from trained values once
    their output projections leave zero. Taps, fc and the final norm are the given drafter's."""
    cfg = drafter.config
    have = cfg.num_hidden_layers
    if layers < have:
        raise ValueError(f"--layers {layers}: the --init drafter already has {have} layers (a drafter only grows)")
    if cfg.scan_layers:
        raise ValueError("grow takes a drafter with unrolled layers (load_drafter(..., scan_layers=False))")
    if layers == have:
        return drafter
    deeper = random_drafter(dataclasses.replace(cfg, num_hidden_layers=layers),
                            jax.tree.leaves(drafter.state)[0].dtype)
    src, dst = nnx.to_pure_dict(drafter.state), nnx.to_pure_dict(deeper.state)
    for name, tree in src.items():  # fc, norms, ...: the given drafter's
        if name != "layers":
            dst[name] = tree
    for i in range(layers):
        layer = copy.deepcopy(src["layers"][min(i, have - 1)])
        if i >= have:
            for proj in (layer["self_attn"]["o_proj"], layer["mlp"]["down_proj"]):
                for leaf in proj:  # weight, and bias when the config has them
                    proj[leaf] = jnp.zeros_like(proj[leaf])
        dst["layers"][i] = layer
    nnx.replace_by_pure_dict(deeper.state, dst)
    # path None: it is no longer the checkpoint at the init's path (calibrations key on a drafter's path)
    return dataclasses.replace(drafter, config=deeper.config, graphdef=deeper.graphdef, state=deeper.state,
                               path=None)


def widen_taps(drafter: LoadedDrafter, num_taps: int) -> LoadedDrafter:
    """`drafter` reading `num_taps` target layers (DFlash's spacing, `default_target_layer_ids`) instead
    of its own taps, which must be among them: `fc`'s columns for its own taps are kept where the
    wider feature puts them and the new taps' columns start at zero, so the widened drafter drafts
    exactly as the given one until training moves them.

    Why: the shipped drafter reads 3 of SmolLM2's 30 layers; more depth and more data stopped paying
    at that size (`docs/internals.md`, drafter training), and what it reads of the target is the
    other input a drafter has."""
    cfg = drafter.config
    have = tuple(cfg.target_layer_ids)
    if num_taps == len(have):
        return drafter
    taps = default_target_layer_ids(cfg.num_target_layers, num_taps)
    if num_taps < len(have) or not set(have) <= set(taps):
        raise ValueError(f"--num-taps {num_taps}: DFlash's {num_taps} taps of a {cfg.num_target_layers}-layer target "
                         f"are {list(taps)}, which do not include the --init drafter's own {list(have)} (taps only "
                         "widen; pass a count whose taps contain them, or train without --init)")
    wider = random_drafter(dataclasses.replace(cfg, target_layer_ids=taps), jax.tree.leaves(drafter.state)[0].dtype)
    src = nnx.to_pure_dict(drafter.state)
    old = src["fc"]["weight"]  # [hidden, len(have) * target_hidden]: HF's [out, in], taps in id order
    h = cfg.target_hidden_size
    kept = {t: old[:, i * h:(i + 1) * h] for i, t in enumerate(have)}  # [hidden, h] per own tap
    cols = [kept[t] if t in kept else jnp.zeros((old.shape[0], h), old.dtype) for t in taps]
    # every weight the drafter's own but fc, whose columns now follow the wider taps
    fc = dict(src["fc"], weight=jnp.concatenate(cols, axis=1))  # [hidden, num_taps * target_hidden]
    nnx.replace_by_pure_dict(wider.state, dict(src, fc=fc))
    return dataclasses.replace(drafter, config=wider.config, graphdef=wider.graphdef, state=wider.state, path=None)


def add_head(drafter: LoadedDrafter, rank: int, seed: int = 0, recurrent: bool = False) -> LoadedDrafter:
    """`drafter` plus a new conditioned head of `rank` (`modeling/cond_head.py`; `--cond-head R`): every
    drafter weight kept, fc2 at zero, so it drafts exactly as before until the head is trained. A
    drafter that already has a head keeps it when the rank agrees (another rank is refused); with
    `recurrent` (`--cond-head-recurrent`) a head without `rec` gains one at zero, so the grown head
    drafts exactly as the one it grew from."""
    have = drafter.config.cond_head_rank
    if have and have != rank:
        raise ValueError(f"--cond-head {rank}: the drafter already has a conditioned head of rank {have}")
    if rank < 1:
        raise ValueError(f"--cond-head must be >= 1, got {rank}")
    if have and (drafter.config.cond_head_recurrent or not recurrent):
        return drafter
    grown = random_drafter(dataclasses.replace(drafter.config, cond_head_rank=rank, cond_head_recurrent=recurrent),
                           dtype=jax.tree.leaves(drafter.state)[0].dtype, seed=seed)
    pure = nnx.to_pure_dict(grown.state)
    own = nnx.to_pure_dict(drafter.state)
    if "cond_head" in own:  # fc1 and fc2 as trained; `rec` as initialised (zero)
        own["cond_head"] = {**pure["cond_head"], **own["cond_head"]}
    pure.update(own)  # the drafter's own weights; a new head as initialised
    nnx.replace_by_pure_dict(grown.state, pure)
    return dataclasses.replace(drafter, config=grown.config, graphdef=grown.graphdef, state=grown.state)
