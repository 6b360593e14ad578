"""Chain speculative decoding (the DFlash baseline) as pure, jitted, static-shape steps.

Each step verifies `[root, d_1 .. d_{B-1}]` in one target forward, accepts the longest prefix of
drafts equal to the target's own choices (argmax, or a sample per position at T > 0, so sampling
stays exactly the target's distribution), emits accepted drafts + the bonus token, injects the
committed tokens' features into the drafter and drafts the next block, all before returning to
the host. Rejected tokens' K/V stay in the target cache past the new length and are masked out
and overwritten later: rollback is bookkeeping.

A `proposal(root, start, drafter_logits) -> logits` function can replace or edit the drafter's
per-position logits [b, B-1, vocab] (tests use oracle / half-right drafters without a model).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct

from bastion_jax.decoding import prefill_target
from bastion_jax.modeling.cache import KVCache, causal_mask
from bastion_jax.modeling.cond_head import HeadTables, head_law, head_tables, spine_logits
from bastion_jax.modeling.layers import project
from bastion_jax.sampling import Sampler, argmax, sample
from bastion_jax.step_config import Proposal, StepConfig


@struct.dataclass
class SpecState:
    """Everything a step carries on device between host syncs."""

    target_cache: KVCache
    drafter_cache: KVCache
    root: jax.Array  # [b] last committed token (no K/V yet)
    drafts: jax.Array  # [b, B-1] the next block's drafts
    length: jax.Array  # [b] committed tokens with K/V in the target cache (= root's position)


RANKING_FILE = "vocab_ranking.npy"  # beside a drafter's config.json: int32 ids, most frequent first
DEFAULT_DRAFT_VOCAB = 8192


def asks_for_draft_vocab(spec: str | int | None) -> bool:
    """Whether a --draft-vocab spec names a restriction (a token count), not the default or no restriction:
    what a run without a drafter to restrict must refuse rather than ignore."""
    return str(spec) not in ("None", "auto", "full", "0")


def resolve_draft_vocab(target, drafter, spec: str | int | None) -> "DraftVocab | None":
    """The draft vocabulary a user asked for: "auto" (the drafter's ranking, top 8192, when it ships
    one), "full"/0/None (the whole vocabulary) or N (top N of the ranking, which must exist)."""
    import numpy as np

    if spec in (None, "full", 0, "0") or drafter is None:
        return None
    path = Path(drafter.path) / RANKING_FILE if getattr(drafter, "path", None) else None
    have = path is not None and path.is_file()
    if spec == "auto":
        if not have or target.config.vocab_size <= DEFAULT_DRAFT_VOCAB:
            return None
        n = DEFAULT_DRAFT_VOCAB
    else:
        try:
            n = int(spec)
        except ValueError:
            raise ValueError(f"--draft-vocab must be auto, full or a token count, got {spec!r}") from None
        if not have:
            raise ValueError(f"--draft-vocab {n} needs a token ranking ({RANKING_FILE}) beside the drafter; "
                             f"{getattr(drafter, 'path', None) or 'this drafter'} has none")
    try:
        ranking = np.load(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable token ranking {path}: {e}") from None
    return DraftVocab.from_ranking(target, ranking, min(n, target.config.vocab_size)).with_head(target, drafter)


@struct.dataclass
class DraftVocab:
    """A frequency-ranked draft vocabulary (FR-Spec): the drafter scores only these `N` tokens, so its
    LM head costs N/V of the full one. Verification keeps the target's full vocabulary, so output is
    unchanged; only drafts outside the set become impossible."""

    ids: jax.Array  # [N] int32 target token ids, most frequent first
    weight: jax.Array  # [N, hidden] the target LM head's rows for `ids`
    # a conditioned head's tables over these rows (`cond_head.HeadTables`), made once with the
    # vocabulary (`with_head`) so that drafting does not redo them every step; None: made in the step.
    cond_tables: HeadTables | None = None

    @classmethod
    def from_ranking(cls, target, ranking, n: int) -> "DraftVocab":
        """The `n` most frequent tokens of `ranking` (ids, most frequent first) with `target`'s LM-head rows."""
        import numpy as np

        ids = np.asarray(ranking, np.int64)[:n]
        vocab = target.config.vocab_size
        if not 0 < n <= vocab or len(ids) < n or len(set(ids.tolist())) != n or ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"draft vocabulary of {n} tokens needs {n} distinct ids in [0, {vocab}); the ranking has "
                             f"{len(ids)}")
        head = target.state["lm_head"] if "lm_head" in target.state else target.state["embed_tokens"]
        return cls(jnp.asarray(ids, jnp.int32), jnp.take(head["weight"][...], jnp.asarray(ids), axis=0))

    def with_head(self, target, drafter) -> "DraftVocab":
        """This vocabulary with `drafter`'s conditioned-head tables for `target` (itself when the
        drafter has no head)."""
        if drafter is None or not drafter.config.cond_head_rank:  # (no merge of a headless drafter)
            return self
        head = nnx.merge(drafter.graphdef, drafter.state).cond_head
        tables = head_tables(head, lambda x: project("...h,nh->...n", x, self.weight, jnp.float32),
                             target.state["embed_tokens"]["weight"][...])
        return self.replace(cond_tables=tables)

    def to_target(self, draft_tokens: jax.Array) -> jax.Array:
        """Target ids of indices into this vocabulary; negative entries (padding) stay as they are."""
        return jnp.where(draft_tokens >= 0, self.ids[jnp.maximum(draft_tokens, 0)], draft_tokens)


@struct.dataclass
class StepOutput:
    tokens: jax.Array  # [b, B] emitted tokens, the first `count` valid (accepted drafts + bonus)
    count: jax.Array  # [b] accepted + 1


def head_logits(target, hidden: jax.Array, draft_vocab: Optional[DraftVocab] = None) -> jax.Array:
    """float32 logits of drafter hidden states [..., h]: the target's LM head, or its rows for
    `draft_vocab`'s N tokens -> [..., N]."""
    if draft_vocab is None:
        return target.logits(hidden)
    w = draft_vocab.weight  # [N, h]
    return project("...h,nh->...n", hidden, w, jnp.float32, feature_major=target.config.feature_major)


def draft_logits(target, drafter, drafter_cache: KVCache, features: jax.Array, ctx_start: jax.Array | None,
                 ctx_len: jax.Array, root: jax.Array, *, block_size: int, mask_token_id: int,
                 proposal: Optional[Proposal], draft_vocab: Optional[DraftVocab] = None,
                 active: jax.Array | None = None, with_law: bool = False, cond_tables: HeadTables | None = None,
                 cond_candidates: int = 0):
    """Inject `features` [b, C, F] (first ctx_len real) at ctx_start, then draft the block after `root`.
    `ctx_start` None: the drafter cache is empty (a prefill), the features go to slot 0.

    Returns the per-position logits [b, B-1, vocab] (slot k predicts position s + k, s = root's
    position; over `draft_vocab`'s N tokens when given) and the drafter cache holding context for
    positions [0, s); with `with_law`, also the conditioned head's `HeadLaw` (None without a head),
    from which a tree takes each parent's own law. `cond_tables`: the head's tables over the full
    vocabulary (`head_tables`), made once by the caller, where there is no `draft_vocab` to carry them
    (else they are made here, every call: on CPU products as large as the LM head's).
    `cond_candidates` M > 0: the head corrects each slot's M best head-free columns only
    (`cond_head.HeadLaw`; `StepConfig.cond_candidates`).
    """
    law = None
    b = root.shape[0]
    block = jnp.concatenate([root[:, None], jnp.full((b, block_size - 1), mask_token_id, jnp.int32)], axis=1)
    if drafter is not None:
        hidden, drafter_cache = _drafter_call(*nnx.split(drafter), target.embed_tokens(block), features, ctx_start,
                                              ctx_len, drafter_cache, active)
        logits, law = block_laws(target, drafter.cond_head, hidden[:, 1:], root, draft_vocab, cond_tables,
                                 cond_candidates)
    else:
        logits = jnp.zeros((b, block_size - 1, target.config.vocab_size), jnp.float32)
    if proposal is not None:
        logits = proposal(root, ctx_len if ctx_start is None else ctx_start + ctx_len, logits)
        law = None
    return (logits, drafter_cache, law) if with_law else (logits, drafter_cache)


def block_laws(target, cond_head, hidden: jax.Array, root: jax.Array, draft_vocab: Optional[DraftVocab] = None,
               cond_tables: HeadTables | None = None, cond_candidates: int = 0):
    """A drafted block's logits from its slots' hidden states [b, D, h] (slots 1..D; `root` [b] the
    token before them): the head-free logits [b, D, vocab or N] and None without a conditioned head,
    else the spine's conditioned logits (each slot given the drafted token before it) and the head's
    `HeadLaw`, from which a tree takes each parent's own law. What decoding drafts from
    (`draft_logits`), and what `benchmarks.gate_headroom` replays. `cond_tables`: as in `draft_logits`."""
    logits = head_logits(target, hidden, draft_vocab)  # [b, D, vocab or N]
    if cond_head is None:
        return logits, None
    tables = draft_vocab.cond_tables if draft_vocab is not None else cond_tables
    if tables is None:
        tables = head_tables(cond_head, partial(head_logits, target, draft_vocab=draft_vocab),
                             target.embed_tokens.weight[...])
    law = head_law(cond_head, hidden, logits, tables, cond_candidates)
    return spine_logits(law, root, draft_vocab.ids if draft_vocab is not None else None), law


@partial(jax.jit, static_argnums=0)
def _drafter_call(graphdef: nnx.GraphDef, params: nnx.State, block_emb: jax.Array, features: jax.Array,
                  ctx_start: jax.Array | None, ctx_len: jax.Array, cache: KVCache, active: jax.Array | None):
    """The drafter's call as a nested jit: a request's drafting steps all call it on the same shapes,
    so it is traced and lowered once per program, not in each of them (~0.2 s each on CPU, every
    run: the persistent compilation cache keys on the lowered program). XLA inlines it: the
    compiled step is the same."""
    return nnx.merge(graphdef, params)(block_emb, features, ctx_start, ctx_len, cache, active)


def draft_block(*args, draft_vocab: Optional[DraftVocab] = None, **kwargs) -> tuple[jax.Array, KVCache]:
    """Greedy chain drafts [b, B-1]: losslessness comes from verification, not from drafting."""
    logits, cache = draft_logits(*args, draft_vocab=draft_vocab, **kwargs)[:2]
    drafts = argmax(logits)
    return (draft_vocab.to_target(drafts) if draft_vocab is not None else drafts), cache


def merge_models(cfg: StepConfig, target_state, drafter_state):
    """Merge the split target (and drafter, if any) inside a jitted function."""
    target = nnx.merge(cfg.target_def, target_state)
    drafter = nnx.merge(cfg.drafter_def, drafter_state) if cfg.drafter_def is not None else None
    return target, drafter


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("target_cache", "drafter_cache"))
def spec_prefill(cfg: StepConfig, target_state, drafter_state, target_cache: KVCache, drafter_cache: KVCache,
                 tokens: jax.Array, lengths: jax.Array, key: Sampler,
                 draft_vocab: Optional[DraftVocab] = None, cond_tables: HeadTables | None = None) -> SpecState:
    """Target prefill (tokens [b, bucket] right-padded, lengths [b]) + the drafter's first block
    (`cond_tables`: a conditioned head's tables over the full vocabulary, see `draft_logits`)."""
    target, drafter = merge_models(cfg, target_state, drafter_state)
    root, target_cache, features = prefill_target(target, target_cache, tokens, lengths, key,
                                                  cfg.tap_layers)
    drafts, drafter_cache = draft_block(target, drafter, drafter_cache, features, None, lengths,
                                        root, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                                        proposal=cfg.proposal, draft_vocab=draft_vocab, cond_tables=cond_tables,
                                        cond_candidates=cfg.cond_candidates)
    return SpecState(target_cache, drafter_cache, root, drafts, lengths + 0)  # fresh buffer: donatable


def accept_chain(drafts: jax.Array, choices: jax.Array) -> jax.Array:
    """Accepted drafts per row: leading k with drafts[k] == choices[k] (choice after slot k). [b]"""
    match = (drafts == choices[:, :-1]).astype(jnp.int32)  # [b, B-1]
    return jnp.sum(jnp.cumprod(match, axis=1), axis=1)


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def spec_step(cfg: StepConfig, target_state, drafter_state, state: SpecState, active: jax.Array, key: Sampler,
              draft_vocab: Optional[DraftVocab] = None, cond_tables: HeadTables | None = None
              ) -> tuple[SpecState, StepOutput]:
    """Verify the current block, accept, emit, inject features and draft the next block."""
    target, drafter = merge_models(cfg, target_state, drafter_state)
    block_size = cfg.block_size
    cache = state.target_cache
    length = state.length
    tokens = jnp.concatenate([state.root[:, None], state.drafts], axis=1)  # [b, B]
    positions = length[:, None] + jnp.arange(block_size)[None]
    out = target(tokens, positions, cache, length, causal_mask(tokens.shape[0], block_size),
                 tap_layers=cfg.tap_layers, active=active)
    choices = sample(out.logits, key)  # [b, B]: the target's token after each slot
    accepted = accept_chain(state.drafts, choices)  # [b]
    bonus = jnp.take_along_axis(choices, accepted[:, None], axis=1)[:, 0]
    slots = jnp.arange(block_size)[None]
    padded_drafts = jnp.concatenate([state.drafts, jnp.zeros_like(state.drafts[:, :1])], axis=1)
    emitted = jnp.where(slots < accepted[:, None], padded_drafts, bonus[:, None])
    emitted = jnp.where(slots <= accepted[:, None], emitted, -1)
    new_length = jnp.where(active, length + accepted + 1, length)
    n_ctx = jnp.where(active, accepted + 1, 0)
    features = out.taps if out.taps is not None else jnp.zeros((tokens.shape[0], block_size, 1), jnp.float32)
    drafts, drafter_cache = draft_block(target, drafter, state.drafter_cache, features, length, n_ctx, bonus,
                                        block_size=block_size, mask_token_id=cfg.mask_token_id,
                                        proposal=cfg.proposal, draft_vocab=draft_vocab, active=active,
                                        cond_tables=cond_tables, cond_candidates=cfg.cond_candidates)
    new_state = SpecState(out.cache, drafter_cache, bonus, drafts, new_length)
    return new_state, StepOutput(emitted, accepted + 1)
