"""An optional parent-conditioned output head for a DFlash drafter (not part of the z-lab format).

Why: a DFlash block drafts every slot from the same all-mask block, so slot k's law is a marginal
over the drafter's doubt about slots < k. Verification accepts slot k only when every earlier draft
was right, so the law that pays is slot k's *given the tokens before it*. The head adds that:

    u_k = silu(fc1([h_k ; e(x_{k-1})]) + rec(u_{k-1})),   z_k = h_k + fc2(u_k),   u_0 = 0

with h_k the drafter's final hidden state of slot k, e the target's embedding and x_0 the block's
root. Without `rec` (the first heads, `recurrent` false) slot k sees only the token just before it;
with it, u_{k-1} carries every drafted token back to the root (the block's first slots know the root
from the drafter itself, so what `rec` adds is x_1..x_{k-2} from slot 3 on). `fc2` and `rec` start
at zero, so a new head is exactly the drafter without one, and a grown `rec` exactly the head it
grew from. Training conditions on the true previous tokens (`training/forward.conditioned`);
drafting on the drafted ones (`spine_logits`): slot 1 on the root, slot k on the argmax of slot k-1's
conditioned law. For a chain that is exact teacher forcing while the run lasts (the drafts before an
accepted one are the true tokens); a tree uses the conditioned laws along that spine as its
per-depth marginals, or takes depths 2..N from each parent's own law (`child_log_probs`, which
hands each parent's state to its children). The shipped SmolLM2 head (rank 256, recurrent; 1,200 +
900 CPU steps on the frozen v14): chain tau 1.67 -> 1.81 (+8%), 32-node trees with depths 2-4 per
parent 2.31 -> 2.54 (+10%) on the evaluation sets, lookup off; the recurrent state's own share is
about half of its last 3% (`benchmarks/results/cpu-smollm2-cond-head.md`).

Cost: with H the LM-head rows the drafter scores, slot k's logits are H h_k + (H W2) u_k: the first
term for every slot in one product (as without a head), the second an [N, rank] table (`head_table`,
made once per engine: with the draft vocabulary, or for the chain's full vocabulary) times the
rank-sized u_k, one slot after another (`rec` adds a [rank, rank] product per slot). Small on an
accelerator; on a 2-core CPU those 15 sequential products (and a tree's per-parent ones) cost more
than the CPU's small trees gain. With candidates (`HeadLaw`, `Engine(cond_candidates=...)`, 64 by
default on CPU) the head corrects only each slot's best head-free columns, which cuts its extra
draft time there from ~10 to ~2 ms with depths 2-4; with drafter v17 (trained as one pair with the
head) that pays on CPU too, and the head drafts by default on every backend
(`checkpoints.cond_head.default_cond_head`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from bastion_jax.modeling.layers import Linear, project


class CondHead(nnx.Module):
    """`fc1` [rank, 2h] (+ bias) over [hidden ; previous token's embedding], `fc2` [h, rank] back to a
    residual added to the hidden state, and with `recurrent` `rec` [rank, rank] from the previous
    slot's state (names as `torch.nn.Linear` modules would store them)."""

    def __init__(self, hidden_size: int, rank: int, *, recurrent: bool = False, dtype: jnp.dtype = jnp.float32,
                 rngs: nnx.Rngs):
        self.fc1 = Linear(2 * hidden_size, rank, use_bias=True, dtype=dtype, rngs=rngs)
        self.fc2 = Linear(rank, hidden_size, dtype=dtype, rngs=rngs)
        self.fc2.weight = nnx.Param(jnp.zeros((hidden_size, rank), dtype))  # a new head changes nothing
        self.rec = Linear(rank, rank, dtype=dtype, rngs=rngs) if recurrent else None
        if self.rec is not None:
            self.rec.weight = nnx.Param(jnp.zeros((rank, rank), dtype))  # nor does a new `rec`
        self.hidden_size = hidden_size

    def __call__(self, hidden: jax.Array, prev_emb: jax.Array, state: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        """hidden [..., h] conditioned on prev_emb [..., h] (the previous token's embedding) and the
        previous slot's state [..., rank] (None: slot 1's, zero) -> (hidden [..., h], state [..., rank])."""
        x = jnp.concatenate([hidden, prev_emb.astype(hidden.dtype)], axis=-1)  # [..., 2h]
        pre = self.fc1(x)
        if self.rec is not None and state is not None:
            pre = pre + self.rec(state.astype(pre.dtype))
        u = jax.nn.silu(pre)  # [..., rank]
        return hidden + self.fc2(u), u

    def split_fc1(self) -> tuple[jax.Array, jax.Array]:
        """fc1's columns for the hidden state and for the embedding: [rank, h] each."""
        w = self.fc1.weight[...]
        return w[:, : self.hidden_size], w[:, self.hidden_size:]


def head_table(head: CondHead, lm_head: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """H W2 [N, rank]: the LM head (`lm_head`, hidden [..., h] -> logits [..., N]) applied to fc2's
    columns, so that H (h + W2 u) = H h + table u."""
    return lm_head(head.fc2.weight[...].T.astype(jnp.float32)).T  # [rank, N] -> [N, rank]


def embed_table(head: CondHead, embed: jax.Array) -> jax.Array:
    """W1e e(x) [V, rank] float32 for every token x of the embedding table `embed` [V, h]: fc1's
    embedding columns applied once, so that a slot's state gathers its previous token's row.

    Why a table and not the embedding's rows times W1e in the step: inside the tree's depth loop a
    gather from a bf16 table made XLA:CPU materialise the whole [V, h] table every step (converted
    to float32 at first, then as a 16-bit copy: ~19 ms of a SmolLM2 bf16 tree step; a float32 table
    is gathered in place). The table is float32 whatever the model's dtype; a slot's row is rounded
    to the drafter's dtype where it is used, as the product's own result was."""
    _, w_e = head.split_fc1()
    return project("vh,rh->vr", embed, w_e, jnp.float32)  # [V, rank]


class HeadTables(NamedTuple):
    """A conditioned head's products with weights that do not change between steps, made once per
    engine and passed to every drafting step (`head_tables`): remaking them in a step costs a
    product as large as the LM head's."""

    logits: jax.Array  # [N, rank] float32 H W2 over the N columns a path drafts (`head_table`)
    embed: jax.Array  # [V, rank] float32 W1e e(x) for every target token x (`embed_table`)


def head_tables(head: CondHead, lm_head: Callable[[jax.Array], jax.Array], embed: jax.Array) -> HeadTables:
    """`HeadTables` of `head` for the LM head `lm_head` (hidden [..., h] -> logits [..., N]) and the
    target's embedding table `embed` [V, h]."""
    return HeadTables(head_table(head, lm_head), embed_table(head, embed))


class HeadLaw(NamedTuple):
    """What a block's conditioned laws need, computed once per drafting call: slot k's law given a
    previous token x is log_softmax(base[k] + table silu(a[k] + W1e e(x))). Batched over rows in `a`
    and `base` (and the candidate fields); the rest is shared.

    With candidates (`head_law(..., candidates=M)`), the head corrects only each slot's M most likely
    columns under its head-free law (`cols`) and the other columns keep their head-free logits, whose
    mass (`tail`) enters each conditioned law's normaliser as it is. Why: slot by slot, the full
    correction is a [N, rank] product per slot in the spine and per kept parent in a tree's depths
    (63 x 8,192 x 256 per depth at SmolLM2), which on a 2-core CPU costs more than the head's
    acceptance buys; the candidates' is [M, rank]. Drafting needs good laws, not exact ones
    (verification keeps the output exact). The other columns' own corrections are taken as zero, so
    a head that moves every column alike skews the candidates' share of the mass; on the evaluation
    sets the shipped head on 64 of 8,192 columns keeps its whole acceptance gain
    (`benchmarks/results/cpu-smollm2-head-candidates.md`). The spine drafts a candidate unless the
    best other column's head-free logit (`out`) beats every conditioned candidate."""

    a: jax.Array  # [b, D, rank] fc1's hidden columns times each slot's hidden state, + bias
    base: jax.Array  # [b, D, N] float32 logits without the head (H h)
    embed: jax.Array  # [V, rank] float32 (`embed_table`)
    table: jax.Array  # [N, rank] (`head_table`)
    w_rec: jax.Array | None = None  # [rank, rank] `rec` (a recurrent head), else None
    cols: jax.Array | None = None  # [b, D, M] int32 each slot's candidate columns (None: every column)
    table_c: jax.Array | None = None  # [b, D, M, rank] their rows of `table`
    base_c: jax.Array | None = None  # [b, D, M] float32 their head-free logits
    tail: jax.Array | None = None  # [b, D] float32 logsumexp of the other columns' head-free logits
    out: jax.Array | None = None  # [b, D] float32 the best other column's head-free logit
    out_col: jax.Array | None = None  # [b, D] int32 its column


# The axes a vmap over rows maps: `a`, `base` and the candidate fields per row, the rest shared.
LAW_ROW_AXES = HeadLaw(0, 0, None, None, None, 0, 0, 0, 0, 0, 0)


def head_law(head: CondHead, hidden: jax.Array, base: jax.Array, tables: HeadTables,
             candidates: int = 0) -> HeadLaw:
    """hidden: [b, D, h] slots 1..D's hidden states; base: [b, D, N] their logits without the head;
    tables: the head's `HeadTables` (over the same N columns); `candidates` M > 0 (and < N): the head
    corrects each slot's M best head-free columns only (see `HeadLaw`)."""
    w_h, _ = head.split_fc1()
    table = tables.logits
    a = project("...h,rh->...r", hidden, w_h) + head.fc1.bias[...]  # [b, D, rank]: every slot at once
    w_rec = head.rec.weight[...] if head.rec is not None else None
    base = base.astype(jnp.float32)
    law = HeadLaw(a, base, tables.embed, table, w_rec)
    if not 0 < candidates < base.shape[-1]:
        return law
    # The barrier keeps XLA:CPU from turning top-k into a full sort (as in `tree.build_tree`).
    top, top_cols = jax.lax.optimization_barrier(jax.lax.top_k(base, candidates + 1))  # [b, D, M + 1]
    base_c, cols = top[..., :candidates], top_cols[..., :candidates].astype(jnp.int32)  # [b, D, M]
    rows, slots = jnp.arange(base.shape[0])[:, None, None], jnp.arange(base.shape[1])[None, :, None]
    tail = jax.nn.logsumexp(base.at[rows, slots, cols].set(-jnp.inf), axis=-1)  # [b, D] (-inf: no other mass)
    return law._replace(cols=cols, table_c=jnp.take(table, cols, axis=0), base_c=base_c, tail=tail,
                        out=top[..., candidates], out_col=top_cols[..., candidates].astype(jnp.int32))


def head_state(law: HeadLaw, slot: jax.Array, prev: jax.Array, state: jax.Array) -> jax.Array:
    """u [..., rank] of slot `slot` (0-based: slot 1 is 0) given previous target ids `prev` [...] and
    the previous slot's states [..., rank] (zeros for slot 1; unread without `rec`), for one row's law
    (`a` [D, rank])."""
    pre = law.a[slot] + jnp.take(law.embed, prev, axis=0).astype(law.a.dtype)  # [..., rank]
    if law.w_rec is not None:
        pre = pre + project("...r,sr->...s", state.astype(pre.dtype), law.w_rec)
    return jax.nn.silu(pre)


def candidate_logits(law: HeadLaw, slot: jax.Array, prev: jax.Array, state: jax.Array
                     ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """(logits [..., C], their columns [C] or None for all N, u [..., rank]) of slot `slot` given `prev`
    and the previous slot's state (`head_state`), for one row's law: H h + table u over every column,
    or over the slot's candidates when the law has them."""
    u = head_state(law, slot, prev, state)
    if law.cols is None:
        return law.base[slot] + project("...r,nr->...n", u, law.table, jnp.float32), None, u
    return law.base_c[slot] + project("...r,mr->...m", u, law.table_c[slot], jnp.float32), law.cols[slot], u


def root_state(law: HeadLaw, root: jax.Array) -> jax.Array:
    """Slot 1's state [rank] given the root (one row's law): what a tree's root hands its children."""
    return head_state(law, 0, root, jnp.zeros(law.a.shape[-1:], law.a.dtype))


def child_log_probs(law: HeadLaw, slot: jax.Array, parents: jax.Array, states: jax.Array
                    ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """One row's law of slot `slot` for each parent token [m], given the states [m, rank] their own
    parents handed down -> (log-probs [m, C], their columns [C] (None: all N), the parents' states
    [m, rank] for their children) (`tree.build_tree`'s `child_law`: the children of depth slot + 1
    drawn from each kept parent's own law). With candidates, the log-probs are the candidates' under
    the law whose other columns keep their head-free logits (normalised with `tail`)."""
    logits, cols, u = candidate_logits(law, slot, parents, states)
    if cols is None:
        return jax.nn.log_softmax(logits, axis=-1), None, u
    norm = jnp.logaddexp(jax.nn.logsumexp(logits, axis=-1), law.tail[slot])  # [...]
    return logits - norm[..., None], cols, u


def spine_logits(law: HeadLaw, root: jax.Array, ids: jax.Array | None) -> jax.Array:
    """Every slot's logits [b, D, N] float32 conditioned on the drafted tokens before it: slot 1 given
    the root [b] (target ids), slot k given slot k-1's argmax under its own conditioned law (the spine
    a greedy chain drafts); `ids` [N] maps columns to target ids (a reduced draft vocabulary; None:
    the column is the id). With candidates, only each slot's candidates are conditioned and the
    other columns keep their head-free logits; the spine's next token is the argmax of that whole
    row (a candidate, or the best other column when its head-free logit beats them all), so a
    chain drafted from these rows is the one each slot was conditioned on."""
    rows = law.a.shape[0]

    def slot(carry: tuple[jax.Array, jax.Array], k: jax.Array) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        prev, state = carry  # [b], [b, rank]
        logits, cols, u = jax.vmap(candidate_logits, in_axes=(LAW_ROW_AXES, None, 0, 0),
                                   out_axes=(0, 0 if law.cols is not None else None, 0))(law, k, prev, state)
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [b] column (of the candidates: [b, M] -> [b])
        if cols is not None:
            best_c = jnp.take_along_axis(cols, best[:, None], axis=1)[:, 0]
            beaten = law.out[:, k] > jnp.max(logits, axis=-1)  # the best other column's logit wins the row
            best = jnp.where(beaten, law.out_col[:, k], best_c)
        return ((best if ids is None else ids[best]), u), logits  # [b], [b, C]

    state0 = jnp.zeros(law.a.shape[:1] + law.a.shape[2:], law.a.dtype)  # [b, rank]
    # Unrolled: the slots' products are small, and on XLA:CPU a loop's per-iteration overhead is
    # most of their time.
    _, logits = jax.lax.scan(slot, (root.astype(jnp.int32), state0), jnp.arange(law.a.shape[1]), unroll=True)
    logits = jnp.moveaxis(logits, 0, 1)  # [b, D, C]
    if law.cols is None:
        return logits
    d = law.a.shape[1]
    return law.base.at[jnp.arange(rows)[:, None, None], jnp.arange(d)[None, :, None], law.cols].set(logits)


def default_cond_depths() -> int:
    """Tree depths whose children come from each parent's own law when the drafter ships a conditioned
    head (`tree.build_tree`; `Engine(cond_depths=None)`): 2-4 on every backend. On CPU, with 64
    candidates per slot and drafter v17, depths 2-4 ran bastion 1.31x AR and the spine alone 1.28x
    (chat 0.98x: `benchmarks/results/cpu-smollm2-drafter-v17-ab.md`); elsewhere a few small kernels
    per depth beside the target's verify."""
    return 4


def default_cond_candidates() -> int:
    """Columns per slot the conditioned head corrects by default (`HeadLaw`; `Engine(cond_candidates=
    None)`): on CPU 64, where the full correction's products cost more than the head's acceptance
    buys; elsewhere every column (0). A count at or above a path's vocabulary (the chain drafts over
    the full one, trees over the draft vocabulary) corrects every column there."""
    return 64 if jax.default_backend() == "cpu" else 0
