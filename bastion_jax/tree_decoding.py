"""BASTION decoding steps: verify a bucketed draft tree in one target forward, then draft the next.

One jitted function per bucket b (root + b-1 nodes; b static) so every shape is compiled once at
warm-up. The state keeps the full tree (the largest bucket); a step verifies its first b nodes.
At temperature T every node gets its own target sample and the walk follows the child equal to
that sample, so each committed token is an exact target sample (DDTree's rule; public BASTION
matches argmax instead, which is not lossless).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct

from bastion_jax.datastore import Datastore
from bastion_jax.decoding import prefill_target
from bastion_jax.lookup import Chain, LookupState, advance, chain_curve, init_state, primary
from bastion_jax.modeling.cache import KVCache, append_rows, causal_mask, write_rows
from bastion_jax.modeling.cond_head import LAW_ROW_AXES, HeadLaw, child_log_probs, root_state
from bastion_jax.sampling import Sampler, argmax, sample
from bastion_jax.speculative import DraftVocab, StepOutput, draft_logits, merge_models
from bastion_jax.step_config import StepConfig
from bastion_jax.tree import Tree, build_tree, chain_tree, slice_tree, surrogate_curve
from bastion_jax.verify import compact_cache, walk

HOLD, DRAFT, FLUSH = 0, 1, 2  # what a step does after committing (see `_then`)


@struct.dataclass
class TreeState:
    target_cache: KVCache
    drafter_cache: KVCache
    tree: Tree  # batched, max-bucket nodes; node 0 is the root (last committed token, no K/V yet)
    length: jax.Array  # [b] committed tokens with K/V in the target cache (= root's position)
    # Tap features of committed tokens the drafter has not read yet (steps that did not draft):
    # positions [length - pending_len, length). The next drafting step injects them first.
    pending: jax.Array  # [b, W, F]
    pending_len: jax.Array  # [b]
    # The context lookup's per-row state: token history (the root last; kept whether or not lookup is
    # on), the chain after the root, and how chains fared so far (see `lookup.LookupState`).
    lookup: LookupState


def pending_slots(block_size: int) -> int:
    """W, the feature buffer of steps that do not draft: a tree step adds at most `block_size`
    rows, a root step one; the host flushes (or drafts) before it would overflow."""
    return 2 * block_size


def root_tree(root: jax.Array, like: Tree) -> Tree:
    """A tree holding only `root` [b] (the state after a step that did not draft), shaped like `like`:
    padding nodes (token -1, never accepted) fill the rest so every bucket still slices it."""
    b, n = like.tokens.shape
    node = jnp.arange(n)
    tokens = jnp.where(node[None] == 0, root[:, None].astype(jnp.int32), -1)  # [b, n]
    parents = jnp.broadcast_to(jnp.where(node == 0, -1, 0).astype(jnp.int32), (b, n))
    log_probs = jnp.broadcast_to(jnp.where(node == 0, 0.0, -jnp.inf).astype(jnp.float32), (b, n))
    ancestors = jnp.broadcast_to((node[:, None] == node[None, :]) | (node[None, :] == 0), (b, n, n))
    return Tree(tokens, parents, jnp.zeros((b, n), jnp.int32), log_probs, ancestors)


def held_tree(root: jax.Array, like: Tree, chain: Optional[Chain]) -> Tree:
    """The tree a step that did not draft leaves, shaped like `like`: the root and the lookup chain
    [b, depth] as one path (`tree.chain_tree`; a later tree step may verify it without drafting), or
    the root alone when lookup is off."""
    if chain is None:
        return root_tree(root, like)
    return jax.vmap(chain_tree, in_axes=(0, 0, None))(root, chain, like.tokens.shape[1])


def _next_tree(cfg: StepConfig, target, drafter, drafter_cache, features, ctx_start, ctx_len, root, draft_vocab=None,
               active=None, chain: Optional[Chain] = None):
    logits, drafter_cache, law = draft_logits(target, drafter, drafter_cache, features, ctx_start, ctx_len, root,
                                              block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                                              proposal=cfg.proposal, draft_vocab=draft_vocab, active=active,
                                              with_law=True, cond_candidates=cfg.cond_candidates)
    ids = draft_vocab.ids if draft_vocab is not None else None  # columns of a reduced vocabulary -> token ids
    if cfg.cond_depths < 2:
        law = None
    tree, curve = draft_trees(cfg.buckets, cfg.top_k, cfg.cond_depths if law is not None else 0, root, logits, ids,
                              chain, law)
    return tree, curve, drafter_cache


@partial(jax.jit, static_argnums=(0, 1, 2))
def draft_trees(buckets: tuple[int, ...], top_k: int, cond_depths: int, root: jax.Array, logits: jax.Array,
                ids: Optional[jax.Array], chain: Optional[Chain], law: Optional[HeadLaw]) -> tuple[Tree, jax.Array]:
    """Every row's best-first tree from the draft's logits [b, B-1, vocab or N], and its surrogate
    curve [b, n_buckets]; with a conditioned head's `law`, depths 2..cond_depths from each parent's
    own law. A nested jit, like `lookup.current_chain`: traced and lowered once per program instead
    of in each drafting step (XLA inlines it)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [b, B-1, vocab or N]

    def one(root: jax.Array, lp: jax.Array, chain: Optional[Chain], law: Optional[HeadLaw]) -> Tree:
        if law is None:
            return build_tree(root, lp, max(buckets), top_k, ids, chain)
        return build_tree(root, lp, max(buckets), top_k, ids, chain, partial(child_log_probs, law), cond_depths,
                          root_state(law, root))

    law_axes = LAW_ROW_AXES if law is not None else None
    tree = jax.vmap(one, in_axes=(0, 0, 0 if chain is not None else None, law_axes))(root, log_probs, chain, law)
    return tree, jax.vmap(surrogate_curve, in_axes=(0, None))(tree, buckets)


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("target_cache", "drafter_cache"))
def tree_prefill(cfg: StepConfig, target_state, drafter_state, target_cache: KVCache, drafter_cache: KVCache,
                 tokens: jax.Array, lengths: jax.Array, key: Sampler,
                 draft_vocab: Optional[DraftVocab] = None, store: Optional[Datastore] = None
                 ) -> tuple[TreeState, jax.Array]:
    """Target prefill + the first draft tree. Returns (state, surrogate curve [b, n_buckets])."""
    target, drafter = merge_models(cfg, target_state, drafter_state)
    root, target_cache, features = prefill_target(target, target_cache, tokens, lengths, key,
                                                  cfg.tap_layers)
    batch, slots = root.shape[0], target_cache.max_len
    look, chain = init_state(cfg.lookup, tokens, lengths, root, slots, cfg.block_size - 1, store)
    tree, curve, drafter_cache = _next_tree(cfg, target, drafter, drafter_cache, features, None, lengths, root,
                                            draft_vocab, chain=chain)
    pending = jnp.zeros((batch, pending_slots(cfg.block_size), features.shape[-1]), features.dtype)
    # `lengths + 0`: a fresh buffer, so the first step can donate the state without a copy.
    return TreeState(target_cache, drafter_cache, tree, lengths + 0, pending, jnp.zeros_like(lengths), look), curve


def _then(cfg: StepConfig, then: int, target, drafter, state: TreeState, pending: jax.Array, pending_len: jax.Array,
          ctx_start: jax.Array, root: jax.Array, draft_vocab: Optional[DraftVocab], active: jax.Array,
          chain: Optional[Chain]):
    """What a step does after committing (`then` is static: each variant is its own executable, so
    a step that holds never touches the drafter cache): HOLD buffers the features (the next step is
    a root step), DRAFT drafts the next tree (injecting every buffered feature first), FLUSH injects
    the buffer without drafting. Returns (drafter cache, next tree, curve [b, n_buckets], pending_len):
    the curve of the drafted tree, or for HOLD / FLUSH the lookup chain's alone (zeros without lookup),
    a hint for the draft gate."""
    held = primary(chain)  # of two chains, the one that promises more: what a step that does not draft holds
    if held is not None:  # a step that does not draft reports the lookup chain's own curve
        no_curve = jax.vmap(chain_curve, in_axes=(0, None))(held, cfg.buckets)  # [b, n_buckets]
    else:
        no_curve = jnp.zeros((root.shape[0], len(cfg.buckets)), jnp.float32)
    if then == HOLD:
        return state.drafter_cache, held_tree(root, state.tree, held), no_curve, pending_len
    if then == DRAFT:
        tree, curve, dcache = _next_tree(cfg, target, drafter, state.drafter_cache, pending, ctx_start, pending_len,
                                         root, draft_vocab, active, chain)
        return dcache, tree, curve, jnp.zeros_like(pending_len)
    if then != FLUSH:
        raise ValueError(f"then must be HOLD (0), DRAFT (1) or FLUSH (2), got {then!r}")
    dcache = state.drafter_cache
    if drafter is not None:
        dcache = drafter.inject(pending, ctx_start, pending_len, dcache, target.embed_tokens.weight.dtype, active)
    return dcache, held_tree(root, state.tree, held), no_curve, jnp.zeros_like(pending_len)


def _verify(cfg: StepConfig, target, state: TreeState, active: jax.Array, key: Sampler, bucket: int):
    """Verify the first `bucket` nodes of the tree and walk it. Returns (emitted [b, D + 1], accepted
    [b], bonus [b], the path's features [b, D + 1, F], the target cache with the path's K/V compacted
    to slots length..)."""
    if bucket not in cfg.buckets:  # (static: raised at trace time) a slice past the tree would clamp silently
        raise ValueError(f"unknown bucket {bucket}: this step was configured for buckets "
                         f"{', '.join(map(str, cfg.buckets))}")
    tree = slice_tree(state.tree, bucket)
    length = state.length
    tokens = jnp.maximum(tree.tokens, 0)  # padding nodes (-1) embed token 0; they can never be accepted
    positions = length[:, None] + tree.depths  # [b, n]
    out = target(tokens, positions, state.target_cache, length, tree.ancestors, tap_layers=cfg.tap_layers,
                 active=active)
    choices = sample(out.logits, key)  # [b, n]: the target's token after each node
    depth = cfg.block_size - 1
    path, accepted = jax.vmap(walk, in_axes=(0, 0, 0, None))(tree.tokens, tree.parents, choices, depth)
    last = jnp.take_along_axis(path, accepted[:, None], axis=1)[:, 0]
    bonus = jnp.take_along_axis(choices, last[:, None], axis=1)[:, 0]
    slots = jnp.arange(depth + 1)[None]
    path_tokens = jnp.take_along_axis(tree.tokens, path, axis=1)  # [b, depth + 1], root first
    emitted = jnp.where(slots < accepted[:, None], jnp.roll(path_tokens, -1, axis=1), bonus[:, None])
    emitted = jnp.where(slots <= accepted[:, None], emitted, -1)
    features = (jnp.take_along_axis(out.taps, path[:, :, None], axis=1) if out.taps is not None
                else jnp.zeros((tokens.shape[0], depth + 1, 1), jnp.float32))  # [b, depth + 1, F]
    # Only the first accepted + 1 <= bucket path entries are kept.
    return emitted, accepted, bonus, features, compact_cache(out.cache, length, path[:, :bucket], active)


def _commit(cfg: StepConfig, then: int, target, drafter, state: TreeState, active: jax.Array, emitted: jax.Array,
            accepted: jax.Array, bonus: jax.Array, features: jax.Array, target_cache: KVCache,
            draft_vocab: Optional[DraftVocab], store: Optional[Datastore]) -> tuple[TreeState, StepOutput, jax.Array]:
    """After a verify: lengths, the feature buffer, the lookup, then `then` (see `_then`)."""
    length = state.length
    new_length = jnp.where(active, length + accepted + 1, length)
    n_ctx = jnp.where(active, accepted + 1, 0)
    # A step that verifies a held chain (then=HOLD) may start with rows already buffered: only the
    # committed rows are written, and the host keeps them inside the buffer (`DraftGate.chain_bucket`).
    pending = append_rows(state.pending, features, state.pending_len, n_ctx)  # [b, W, F]
    # The accepted drafts and the bonus (the new root) go to positions length + 1 .. new_length.
    look, chain = advance(cfg.lookup, state.lookup, emitted, length, n_ctx, store)
    drafter_cache, next_tree, curve, pending_len = _then(
        cfg, then, target, drafter, state, pending, state.pending_len + n_ctx, length - state.pending_len, bonus,
        draft_vocab, active, chain)
    new_state = TreeState(target_cache, drafter_cache, next_tree, new_length, pending, pending_len, look)
    return new_state, StepOutput(emitted, accepted + 1), curve


@partial(jax.jit, static_argnames=("cfg", "bucket", "then"), donate_argnames=("state",))
def tree_step(cfg: StepConfig, target_state, drafter_state, state: TreeState, active: jax.Array, key: Sampler,
              draft_vocab: Optional[DraftVocab] = None, store: Optional[Datastore] = None, *, bucket: int,
              then: int = 1) -> tuple[TreeState, StepOutput, jax.Array]:
    """Verify the first `bucket` nodes of the tree, accept, compact, then (`then`, see `_then`) draft
    the next tree (1, the default), or hold the new features for a later draft (0) or flush (2)."""
    target, drafter = merge_models(cfg, target_state, drafter_state)
    emitted, accepted, bonus, features, target_cache = _verify(cfg, target, state, active, key, bucket)
    return _commit(cfg, then, target, drafter, state, active, emitted, accepted, bonus, features, target_cache,
                   draft_vocab, store)


@partial(jax.jit, static_argnames=("cfg", "then"), donate_argnames=("state",))
def root_step(cfg: StepConfig, target_state, drafter_state, state: TreeState, active: jax.Array, key: Sampler,
              draft_vocab: Optional[DraftVocab] = None, store: Optional[Datastore] = None, *,
              then: int = 0) -> tuple[TreeState, StepOutput, jax.Array]:
    """A plain AR step for a state that holds no draft (the previous step did not draft): the
    target forward on the root alone (no tree mask, walk or compaction), its features buffered,
    then hold (0), draft the next tree (1) or flush the buffer into the drafter (2)."""
    target, drafter = merge_models(cfg, target_state, drafter_state)
    root = state.tree.tokens[:, 0]
    length = state.length
    cache = state.target_cache
    out = target(root[:, None], length[:, None], cache, length, causal_mask(root.shape[0], 1),
                 tap_layers=cfg.tap_layers, active=active)
    choice = sample(out.logits, key)[:, 0]  # [b]
    features = (out.taps if out.taps is not None else jnp.zeros((root.shape[0], 1, 1), jnp.float32))  # [b, 1, F]
    n_new = active.astype(jnp.int32)
    pending = write_rows(state.pending, features.astype(state.pending.dtype), state.pending_len, active)
    look, chain = advance(cfg.lookup, state.lookup, choice[:, None], length, n_new, store)
    drafter_cache, next_tree, curve, pending_len = _then(
        cfg, then, target, drafter, state, pending, state.pending_len + n_new, length - state.pending_len, choice,
        draft_vocab, active, chain)
    new_state = TreeState(out.cache, drafter_cache, next_tree, length + n_new, pending, pending_len, look)
    return new_state, StepOutput(choice[:, None], jnp.ones_like(length)), curve


# -- the two halves of a step, jitted on their own for the profiler ------------------------------

@partial(jax.jit, static_argnames=("cfg", "bucket"), donate_argnames=("target_cache",))
def tree_verify(cfg: StepConfig, target_state, target_cache: KVCache, tree: Tree, length: jax.Array, *,
                bucket: int) -> tuple[KVCache, jax.Array]:
    """Verify only: the target forward of `tree_step` over the first `bucket` nodes at context `length`
    (tree attention mask, taps) and the argmax at every node. Returns (cache, choices [b, bucket]).

    The profiler times this against the full step to split a step into verify / draft / rest.
    """
    target = nnx.merge(cfg.target_def, target_state)
    if not 1 <= bucket <= tree.tokens.shape[-1]:
        raise ValueError(f"bucket {bucket} is not a prefix of a tree of {tree.tokens.shape[-1]} nodes")
    tree = slice_tree(tree, bucket)
    positions = length[:, None] + tree.depths  # [b, n]
    out = target(jnp.maximum(tree.tokens, 0), positions, target_cache, length, tree.ancestors,
                 tap_layers=cfg.tap_layers)
    return out.cache, argmax(out.logits)


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("drafter_cache",))
def tree_draft(cfg: StepConfig, target_state, drafter_state, drafter_cache: KVCache, features: jax.Array,
               ctx_start: jax.Array, ctx_len: jax.Array, root: jax.Array,
               draft_vocab: Optional[DraftVocab] = None) -> tuple[KVCache, Tree, jax.Array]:
    """Draft only: inject `features` [b, C, F], run the drafter's block after `root` and build the
    next tree (the second half of `tree_step`). Returns (drafter cache, tree, curve [b, n_buckets])."""
    target, drafter = merge_models(cfg, target_state, drafter_state)
    tree, curve, drafter_cache = _next_tree(cfg, target, drafter, drafter_cache, features, ctx_start, ctx_len, root,
                                            draft_vocab)
    return drafter_cache, tree, curve
