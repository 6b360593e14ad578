"""`StepConfig`: everything static about a decoding step, in one hashable value.

Every jitted step (`decoding`, `speculative`, `tree_decoding`) takes it as its first, static
argument: the models' graph definitions, the drafter's block and mask token,
the tapped target layers, an optional proposal hook, the tree buckets and width, the context lookup. Two calls with
equal configs and shapes share one compiled executable; anything that changes the compiled code
is in here, so a changed setting can never silently reuse a stale compilation. Sampling is not:
temperature (0: greedy), top-k and top-p travel as arrays in the `sampling.Sampler` each step
takes, so a request with other values compiles nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax
from flax import nnx

from bastion_jax.lookup import LookupConfig

# proposal(root [b], root position [b], drafter logits [b, B-1, V]) -> logits: replaces or edits the
# drafter's per-position logits inside the step (tests use oracle and half-right drafters with it).
Proposal = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    target_def: nnx.GraphDef
    drafter_def: Optional[nnx.GraphDef] = None
    block_size: int = 0  # drafted block incl. the root (0: no drafting, AR only)
    mask_token_id: int = 0
    tap_layers: tuple[int, ...] = ()  # target layers whose outputs feed the drafter
    proposal: Optional[Proposal] = None
    buckets: tuple[int, ...] = (1,)  # tree sizes a tree step can verify (the tree holds max(buckets) nodes)
    top_k: int = 1  # tree width: children considered per node
    lookup: Optional[LookupConfig] = None  # context-lookup chain in every draft tree (see `lookup.py`); None: off
    # Tree depths 2..cond_depths take each parent's own law from the drafter's conditioned head
    # (`tree.build_tree`'s child_law); 0: the spine's laws for every depth (and always without a head).
    cond_depths: int = 0
    # With a conditioned head, it corrects only each slot's cond_candidates best head-free columns
    # (`cond_head.HeadLaw`: a [M, rank] product per slot and parent instead of [N, rank]); 0: all.
    cond_candidates: int = 0

    def __hash__(self) -> int:
        """Computed once: hashing a GraphDef walks the whole module graph (~2 ms at SmolLM2), and the
        executable table is looked up several times per request."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    @classmethod
    def of(cls, target, drafter=None, *, buckets: Sequence[int] = (1,), top_k: int = 1,
           proposal: Optional[Proposal] = None, block_size: Optional[int] = None, mask_token_id: int = 0,
           lookup: Optional[LookupConfig] = None, cond_depths: int = 0, cond_candidates: int = 0) -> "StepConfig":
        """The config for a loaded target (and drafter): block size, mask token and taps come from the
        drafter's config when there is one (`block_size` / `mask_token_id` serve a drafter-less
        proposal); the head's settings only count with a head."""
        has_head = drafter is not None and bool(drafter.config.cond_head_rank)
        if drafter is not None:
            block_size, mask_token_id = drafter.config.block_size, drafter.config.mask_token_id
        return cls(target_def=target.graphdef, drafter_def=drafter.graphdef if drafter is not None else None,
                   block_size=block_size or 0, mask_token_id=mask_token_id,
                   tap_layers=tuple(drafter.config.target_layer_ids) if drafter is not None else (),
                   proposal=proposal, buckets=tuple(sorted(set(int(b) for b in buckets))), top_k=top_k,
                   lookup=lookup,
                   cond_depths=cond_depths if has_head else 0,
                   cond_candidates=cond_candidates if has_head else 0)
