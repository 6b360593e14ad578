"""An optional parent-conditioned output head for a DFlash drafter (not part of the z-lab format).

Why: a DFlash block drafts every slot from the same all-mask block, so slot k's law is a marginal
over the drafter's doubt about slots < k. Verification accepts slot k only when every earlier draft
was right, so the law that pays is slot k's *given the token before it*. The head adds that:

    z_k = h_k + fc2(silu(fc1([h_k ; e(x_{k-1})])))

with h_k the drafter's final hidden state of slot k, e the target's embedding and x_0 the block's
root. `fc2` starts at zero, so a new head is exactly the drafter without one. Training conditions on
the true previous token (`training/step.py`); drafting on the drafted one (`spine_logits`): slot 1 on
the root, slot k on the argmax of slot k-1's conditioned law. For a chain that is exact teacher
forcing while the run lasts (the draft before an accepted one is the true token); a tree uses the
conditioned laws along that spine as its per-depth marginals. Measured on SmolLM2 (rank 64/256, a
frozen drafter, 300 CPU steps; `benchmarks/results/cpu-smollm2-method-probes.md` section 9): chain
walk +2-4%, spine-conditioned trees +1-3%.

Cost: the sequential part is small. With H the LM-head rows the drafter scores, slot k's logits are
H h_k + (H W2) u_k: the first term for every slot in one product (as without a head), the second an
[N, rank] table (`head_table`, computed once per request with the draft vocabulary) times the
rank-sized u_k, one slot after another.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from bastion_jax.modeling.layers import Linear, project


class CondHead(nnx.Module):
    """`fc1` [rank, 2h] (+ bias) over [hidden ; previous token's embedding], `fc2` [h, rank] back to a
    residual added to the hidden state (names as a `torch.nn.Linear` pair would store them)."""

    def __init__(self, hidden_size: int, rank: int, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.fc1 = Linear(2 * hidden_size, rank, use_bias=True, dtype=dtype, rngs=rngs)
        self.fc2 = Linear(rank, hidden_size, dtype=dtype, rngs=rngs)
        self.fc2.weight = nnx.Param(jnp.zeros((hidden_size, rank), dtype))  # a new head changes nothing
        self.hidden_size = hidden_size

    def __call__(self, hidden: jax.Array, prev_emb: jax.Array) -> jax.Array:
        """hidden [..., h] conditioned on prev_emb [..., h] (the previous token's embedding) -> [..., h]."""
        x = jnp.concatenate([hidden, prev_emb.astype(hidden.dtype)], axis=-1)  # [..., 2h]
        return hidden + self.fc2(jax.nn.silu(self.fc1(x)))

    def split_fc1(self) -> tuple[jax.Array, jax.Array]:
        """fc1's columns for the hidden state and for the embedding: [rank, h] each."""
        w = self.fc1.weight[...]
        return w[:, : self.hidden_size], w[:, self.hidden_size:]


def head_table(head: CondHead, lm_head: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """H W2 [N, rank]: the LM head (`lm_head`, hidden [..., h] -> logits [..., N]) applied to fc2's
    columns, so that H (h + W2 u) = H h + table u."""
    return lm_head(head.fc2.weight[...].T.astype(jnp.float32)).T  # [rank, N] -> [N, rank]


def spine_logits(head: CondHead, hidden: jax.Array, base: jax.Array, root: jax.Array,
                 embed: Callable[[jax.Array], jax.Array], table: jax.Array, ids: jax.Array | None) -> jax.Array:
    """Every slot's logits conditioned on the drafted token before it.

    hidden: [b, D, h] slots 1..D's hidden states; base: [b, D, N] their logits without the head (H h);
    root: [b] the block's root (target id); embed: target ids [b] -> embeddings [b, h]; table: [N, rank]
    (`head_table`); ids: [N] target ids of the N columns (a reduced draft vocabulary), None when the
    columns are the ids. Returns [b, D, N] float32: slot 1 given the root, slot k given slot k-1's
    argmax under its own conditioned law (the spine a greedy chain drafts)."""
    w_h, w_e = head.split_fc1()
    a = project("...h,rh->...r", hidden, w_h) + head.fc1.bias[...]  # [b, D, rank]: the hidden part, all slots at once

    def slot(prev: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        a_k, base_k = xs  # [b, rank], [b, N]
        u = jax.nn.silu(a_k + project("...h,rh->...r", embed(prev), w_e))  # [b, rank]
        logits = base_k.astype(jnp.float32) + project("...r,nr->...n", u, table, jnp.float32)  # [b, N]
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [b] column
        return (best if ids is None else ids[best]), logits

    _, logits = jax.lax.scan(slot, root.astype(jnp.int32), (jnp.moveaxis(a, 1, 0), jnp.moveaxis(base, 1, 0)))
    return jnp.moveaxis(logits, 0, 1)  # [b, D, N]
