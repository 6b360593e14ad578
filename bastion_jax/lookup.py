"""Context lookup: the continuation of the latest earlier occurrence of the text's last n tokens,
offered to the draft tree as an extra chain beside the drafter's candidates (and the datastore's
chain, `datastore.py`, beside it when there is one).

Why: a small target repeats itself and its prompt (numbers of a word problem, identifiers in code,
its own sentences). On the target-written training responses of the shipped SmolLM2 pair, the
token after the latest earlier match of the last 4 tokens was the target's next token 77% of the
time, against 44% for the drafter's first token; the drafter never sees the text's tokens, so it
cannot copy them. The lookup costs a few comparisons over the token history on device.

How it enters the tree (`tree.build_tree`): the lookup chain c_1..c_D is scored as its own path
with calibrated probabilities, P(c_1 right) = `first[n]` and P(c_d right | c_<d right) =
`cont[n]` for a match of n tokens, mixed with the drafter's own probability of that token; the
drafter's other tokens under a node of the chain keep the rest of the mass (their probability
times 1 - w); paths that left the chain score as the drafter says. So the surrogate (the sum of
path probabilities) stays an estimate of accepted tokens and the controller prices trees as
before. Verification is unchanged: any tree is lossless.

The probabilities are learnt per request (`LookupState`, `advance`): each step judges the chain it
was offered against the tokens it committed, and `first` / `cont` are posterior means with the
measured table as a prior, since how far a text copies varies (code a lot, LaTeX repeats with other
continuations).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from bastion_jax.datastore import NUM_CLASSES, Datastore, store_chain
from bastion_jax.modeling.cache import append_rows

# P(first token right) and P(next right | previous right) per match length n = 1..4, measured on the
# shipped pair's target-written greedy training responses (runs/data, 500 records, first 96 tokens).
SMOLLM2_FIRST = (0.22, 0.52, 0.61, 0.77)
SMOLLM2_CONT = (0.64, 0.70, 0.75, 0.85)


@dataclasses.dataclass(frozen=True)
class LookupConfig:
    """Static settings of the context lookup: the longest suffix matched (`max_ngram`; shorter ones
    are tried when it has no earlier occurrence) and the chain's probabilities per match length, a
    prior that each request's own outcomes update (`probabilities`)."""

    max_ngram: int = 4
    first: tuple[float, ...] = SMOLLM2_FIRST  # [max_ngram] P(c_1 right) for a match of n = 1.. tokens
    cont: tuple[float, ...] = SMOLLM2_CONT  # [max_ngram] P(c_d right | c_<d right)
    prior_weight: float = 8.0  # the table counts as this many trials against what a request's chains do
    # With a datastore: 2 puts both chains (the context's, the datastore's) in every drafted tree, 1
    # only the one that promises more (`current_chain`)
    tree_chains: int = 2

    def __post_init__(self):
        if self.max_ngram < 1:
            raise ValueError(f"lookup max_ngram must be >= 1, got {self.max_ngram}")
        if self.tree_chains not in (1, 2):
            raise ValueError(f"lookup tree_chains must be 1 or 2, got {self.tree_chains}")
        for name in ("first", "cont"):
            values = getattr(self, name)
            if len(values) != self.max_ngram or not all(0.0 <= v < 1.0 for v in values):
                raise ValueError(f"lookup {name} needs {self.max_ngram} probabilities in [0, 1), got {values}")


class Chain(NamedTuple):
    """One row's lookup chain (add a leading batch axis for rows), or its chains: with a chain axis
    C before `depth` (tokens [C, depth], the others [C]), the context's then the datastore's."""

    tokens: jax.Array  # [depth] int32 c_1..c_D; -1 where there is none (no match, or past the known text)
    first: jax.Array  # [] f32 P(c_1 right); 0 when there is no chain
    cont: jax.Array  # [] f32 P(c_d right | c_<d right)
    order: jax.Array | None = None  # [] int32 the class its outcomes count in (the match length n; 0: no chain)


def find_chain(cfg: LookupConfig, history: jax.Array, root_pos: jax.Array, depth: int,
               probs: tuple[jax.Array, jax.Array] | None = None) -> Chain:
    """The lookup chain after the root at `root_pos` for one row's token `history` [L].

    history[0..root_pos] are the row's tokens so far (prompt, committed tokens, the root last). The
    longest suffix of n <= max_ngram tokens ending at the root with an earlier occurrence ending at
    e < root_pos wins; for it the latest such e, and the chain is history[e + 1 ..], continued past
    the root periodically (what followed the match up to the root is taken to repeat).
    `probs` (first [max_ngram], cont [max_ngram]) replaces the config's table (see `probabilities`).
    """
    slots = history.shape[0]
    e = jnp.arange(slots)  # candidate end of an earlier occurrence
    match = e < root_pos  # [L]; strictly earlier than the suffix itself
    best_end, best_n = jnp.int32(-1), jnp.int32(0)
    for n in range(1, cfg.max_ngram + 1):
        k = n - 1  # compare history[e - k] with history[root_pos - k]
        same = jnp.roll(history, k) == history[jnp.maximum(root_pos - k, 0)]  # [L]: history[e - k] at index e
        match = match & same & (e >= k) & (root_pos >= k)
        end = jnp.max(jnp.where(match, e, -1)).astype(jnp.int32)
        best_end = jnp.where(end >= 0, end, best_end)
        best_n = jnp.where(end >= 0, n, best_n)
    # Past the root the match's continuation is the text since the match itself: history[e + 1 ..
    # root_pos] repeats with period root_pos - e (a text in a loop, a row of digits, a repeated line).
    period = jnp.maximum(root_pos - best_end, 1)
    src = best_end + 1 + jnp.arange(depth) % period  # [depth], always <= root_pos
    found = best_n > 0
    tokens = jnp.where(found, history[jnp.clip(src, 0, slots - 1)], -1).astype(jnp.int32)
    first, cont = probs if probs is not None else (jnp.asarray(cfg.first, jnp.float32), jnp.asarray(cfg.cont, jnp.float32))
    idx = jnp.maximum(best_n - 1, 0)
    return Chain(tokens, jnp.where(found, first[idx], 0.0), jnp.where(found, cont[idx], 0.0), best_n)


# -- learning the chain's probabilities while a request runs ---------------------------------------

@struct.dataclass
class LookupState:
    """What the lookup keeps per row between steps (a part of `TreeState`): the token history, the
    chain offered after the current root, and counts of how chains fared on this text so far."""

    history: jax.Array  # [b, L] int32 the row's tokens by position, the root last
    chain: jax.Array  # [b, depth] (or [b, C, depth] with C chains) int32 the chain after the root (-1: none)
    order: jax.Array  # [b] (or [b, C]) int32 its class (0: none)
    # [b, C, 4] f32 per chain class (match length n, then the datastore's classes): first hits, first
    # trials, cont hits, cont trials
    counts: jax.Array


def probabilities(cfg: LookupConfig, counts: jax.Array, store: Datastore | None = None) -> tuple[jax.Array, jax.Array]:
    """(first [C], cont [C]) for one row, C = max_ngram context classes (+ the datastore's chain
    classes when there is one): the prior tables (the config's, the datastore's) as `prior_weight`
    trials, updated by what this row's chains did (posterior means). The tables were measured on
    one target's text; a text that copies less (or more) moves them within a few steps."""
    k = cfg.prior_weight
    prior_first, prior_cont = jnp.asarray(cfg.first, jnp.float32), jnp.asarray(cfg.cont, jnp.float32)
    if store is not None:
        # The datastore's many classes each see few chains in one request, but how far this text
        # follows the target's usual phrasing is shared: its priors are first scaled by the ratio of
        # hits to prior-expected hits over all its classes (k trials' worth of 1), so a text that
        # copies little (chat) stops offering its chains within a few steps.
        ds = counts[cfg.max_ngram:]  # [NUM_CLASSES, 4]
        scale_first = (jnp.sum(ds[:, 0]) + k) / (jnp.sum(ds[:, 1] * store.first) + k)
        scale_cont = (jnp.sum(ds[:, 2]) + k) / (jnp.sum(ds[:, 3] * store.cont) + k)
        prior_first = jnp.concatenate([prior_first, jnp.minimum(store.first * scale_first, 0.99)])
        prior_cont = jnp.concatenate([prior_cont, jnp.minimum(store.cont * scale_cont, 0.99)])
    first = (counts[:, 0] + k * prior_first) / (counts[:, 1] + k)
    cont = (counts[:, 2] + k * prior_cont) / (counts[:, 3] + k)
    return jnp.minimum(first, 0.99), jnp.minimum(cont, 0.99)


def chain_outcome(chain: jax.Array, committed: jax.Array, count: jax.Array) -> jax.Array:
    """[first hit, first trial, cont hits, cont trials] of one row's `chain` [depth] against the
    `count` tokens it committed next (`committed` [t]): c_1 is tried whenever there is a chain; c_j
    (j > 1) is tried when c_1..c_{j-1} were all right and the target's j-th token is known."""
    depth, t = chain.shape[0], committed.shape[0]
    n = min(depth, t)
    valid = chain[:n] >= 0
    right = valid & (chain[:n] == committed[:n]) & (jnp.arange(n) < count)
    matched = jnp.sum(jnp.cumprod(right.astype(jnp.int32)))  # leading chain tokens the target confirmed
    known = jnp.minimum(jnp.sum(valid.astype(jnp.int32)), jnp.minimum(count, n))  # chain tokens the step could judge
    has = valid[0] & (count > 0)
    cont_trials = jnp.clip(jnp.minimum(matched, known - 1), 0)
    cont_hits = jnp.clip(jnp.minimum(matched - 1, known - 1), 0)
    return jnp.where(has, jnp.stack([(matched > 0).astype(jnp.float32), 1.0, cont_hits.astype(jnp.float32),
                                     cont_trials.astype(jnp.float32)]), 0.0)


def init_state(cfg: LookupConfig | None, tokens: jax.Array, lengths: jax.Array, root: jax.Array, slots: int,
               depth: int, store: Datastore | None = None) -> tuple[LookupState, Chain | None]:
    """The state after prefill: the prompt [b, t] and the first root in the history, no counts yet;
    and the chain after that root (None when lookup is off)."""
    b = root.shape[0]
    history = jnp.zeros((b, slots), jnp.int32).at[:, :tokens.shape[1]].set(tokens[:, :slots])
    history = append_rows(history, root[:, None], lengths, jnp.ones_like(lengths))
    n = (cfg.max_ngram + (NUM_CLASSES if store is not None else 0)) if cfg is not None else 1
    lead = (b, 2) if cfg is not None and store is not None and cfg.tree_chains == 2 else (b,)
    state = LookupState(history, jnp.full(lead + (depth,), -1, jnp.int32), jnp.zeros(lead, jnp.int32),
                        jnp.zeros((b, n, 4), jnp.float32))
    return _with_chain(cfg, state, lengths, store)


def advance(cfg: LookupConfig | None, state: LookupState, committed: jax.Array, length: jax.Array,
            count: jax.Array, store: Datastore | None = None) -> tuple[LookupState, Chain | None]:
    """After a step committed `count[b]` tokens `committed` [b, t] after the root at `length[b]`: count
    how the chain fared, write the tokens (the last is the new root), find the next chain (returned
    too, None when lookup is off)."""
    history = append_rows(state.history, committed, length + 1, count)
    counts = state.counts
    if cfg is not None:  # every chain offered is judged, in its own class
        chains = state.chain if state.chain.ndim == 3 else state.chain[:, None]  # [b, C, depth]
        orders = state.order if state.order.ndim == 2 else state.order[:, None]  # [b, C]
        for c in range(chains.shape[1]):
            outcome = jax.vmap(chain_outcome)(chains[:, c], committed, count)  # [b, 4]
            slot = jax.nn.one_hot(jnp.maximum(orders[:, c] - 1, 0), counts.shape[1]) * (orders[:, c] > 0)[:, None]
            counts = counts + slot[:, :, None] * outcome[:, None, :]  # slot [b, classes]
    return _with_chain(cfg, state.replace(history=history, counts=counts), length + count, store)


def _with_chain(cfg: LookupConfig | None, state: LookupState, root_pos: jax.Array, store: Datastore | None
                ) -> tuple[LookupState, Chain | None]:
    if cfg is None:
        return state, None
    chain = current_chain(cfg, state, root_pos, store)
    return state.replace(chain=chain.tokens, order=chain.order), chain


def primary(chain: Chain | None) -> Chain | None:
    """The one chain [b, depth] of batched chains [b, C, depth] that promises more accepted tokens on
    its own (`expected_length`): what a step that does not draft holds and reports."""
    if chain is None or chain.tokens.ndim == 2:
        return chain
    pick = jnp.argmax(expected_length(chain), axis=1)  # [b]
    return Chain(*(jnp.take_along_axis(a, pick.reshape((-1,) + (1,) * (a.ndim - 1)), 1)[:, 0] for a in chain))


def expected_length(chain: Chain) -> jax.Array:
    """[b] the chain's expected accepted tokens on its own: sum over its tokens of first * cont^(d-1)."""
    d = jnp.arange(chain.tokens.shape[-1], dtype=jnp.float32)
    return jnp.sum(jnp.where(chain.tokens >= 0, chain.first[..., None] * chain.cont[..., None] ** d, 0.0), axis=-1)


@partial(jax.jit, static_argnums=0)
def current_chain(cfg: LookupConfig, state: LookupState, root_pos: jax.Array, store: Datastore | None = None
                  ) -> Chain:
    """The chain after the root at `root_pos` [b], with this text's learnt probabilities (batched):
    the context lookup's; with a datastore (`datastore.py`) both it and the datastore's (tokens
    [b, 2, depth], the context's first), or with `tree_chains` 1 the one that promises more
    accepted tokens. Its `order` is the class its outcomes count in: the match length n for the
    context's, max_ngram + 1 + the datastore class for the datastore's.

    A nested jit: every step runs it on the same shapes, so it is traced and lowered once per
    step's program rather than in each of a request's ~10 steps (~0.35 s each on CPU, the
    datastore's vmapped search most of it, on every run: the persistent compilation cache keys on
    the lowered program); XLA inlines the call, so the compiled step is the same."""
    depth = state.chain.shape[-1]
    first, cont = jax.vmap(partial(probabilities, cfg, store=store))(state.counts)  # [b, C] each
    ctx = jax.vmap(find_chain, in_axes=(None, 0, 0, None, 0))(cfg, state.history, root_pos, depth,
                                                               (first, cont))
    if store is None:
        return ctx
    tokens, cls, found = jax.vmap(store_chain, in_axes=(None, 0, 0, None))(store, state.history, root_pos, depth)
    col = (cfg.max_ngram + cls)[:, None]
    ds = Chain(tokens, jnp.where(found, jnp.take_along_axis(first, col, 1)[:, 0], 0.0),
               jnp.where(found, jnp.take_along_axis(cont, col, 1)[:, 0], 0.0),
               jnp.where(found, cfg.max_ngram + 1 + cls, 0).astype(jnp.int32))
    both = Chain(*(jnp.stack([c, d], axis=1) for c, d in zip(ctx, ds)))  # [b, 2, ...]
    return both if cfg.tree_chains == 2 else primary(both)


def chain_curve(chain: Chain, buckets: tuple[int, ...]) -> jax.Array:
    """The surrogate A(b) of a tree holding only the chain, per bucket: sum over its first b - 1
    nodes of first * cont^(d - 1). What a step that did not draft reports, so the draft gate sees a
    copy coming (a long match) without running the drafter. One row; vmap for rows."""
    depth = chain.tokens.shape[0]
    d = jnp.arange(depth, dtype=jnp.float32)
    probs = jnp.where(chain.tokens >= 0, chain.first * chain.cont ** d, 0.0)  # [depth]
    cum = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(probs)])  # [depth + 1]
    return cum[jnp.asarray([min(b - 1, depth) for b in buckets])]
