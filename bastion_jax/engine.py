"""The engine: one request loop over a loaded target (and drafter), for every policy.

`Engine.stream` validates a request, sizes the cache, gets the compiled steps for its shapes from
`Executables` (compiled once per shape, counted), runs prefill and then one step after another,
choosing for the tree policies each step's bucket (`Controller`, priced by `LatencyModel`) and
whether to draft at all (`DraftGate`), and yields each row's new tokens after every step.

Modes: "ar", "dflash" (chain: draft a block, verify it in one target forward), "fixed:N"
(always an N-node tree), "bastion" and "bastion-paper" (budgeted trees). All share prompt
handling, stop rules (`stats.Rows`) and statistics (`stats.Stats`).
"""

from __future__ import annotations

import numbers
import time
import warnings
from functools import partial
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bastion_jax import compile_counter, tree_decoding, warmup
from bastion_jax.checkpoints import LoadedDrafter, Target
from bastion_jax.controller import Controller, Policy, PolicyError, default_buckets
from bastion_jax.draft_gate import DraftGate
from bastion_jax.executables import Executables
from bastion_jax.latency import DevicePeaks, LatencyModel, ModelDims
from bastion_jax.datastore import Datastore, resolve_datastore
from bastion_jax.lookup import LookupConfig
from bastion_jax.modeling.cond_head import default_cond_candidates, default_cond_depths
from bastion_jax.sampling import KeyStream, SamplingConfig
from bastion_jax.shapes import cache_class, prefill_bucket
from bastion_jax.speculative import DraftVocab, asks_for_draft_vocab, resolve_draft_vocab
from bastion_jax.stats import Result, Rows, Stats
from bastion_jax.loops import ArLoop, ChainLoop
from bastion_jax.tree_loop import TreeLoop

__all__ = ["MODES", "Engine", "GenerationError", "Result", "Stats"]

# CPU backends cannot donate buffers; the warning is noise there.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

MODES = ("ar", "dflash", "fixed:N", "bastion")


class GenerationError(ValueError):
    """A request the engine cannot serve (e.g. prompt longer than the cache)."""


class Engine:
    """Generation over a `Target`, optionally with a DFlash drafter; batches of any prompt lengths.

    `proposal` (dflash mode) replaces or edits the drafter's per-position logits inside the jitted
    step; with no drafter it is the only source of drafts (`block_size` must then be given).
    `lookup` adds the context-lookup chain to every draft tree of the tree modes, and lets bastion
    verify that chain alone when drafting does not pay (`lookup.py`; on by default, None turns it off
    and gives the drafter's trees alone, as the official BASTION code). `draft_vocab` restricts the
    drafter's LM head in the tree modes: "auto" (the default, as the CLI: the drafter's shipped token
    ranking, top 8192, when it has one), "full" or None (every token), N (top N), or a `DraftVocab`.
    `datastore` offers the lookup a second chain, from text the target wrote before (`datastore.py`):
    "auto" (the default: the drafter's `datastore.npz`, when it ships one and lookup is on), a
    file, a loaded `Datastore`, or None / "off". `buckets`: the tree sizes compiled (None:
    `controller.default_buckets()`, capped at 16 nodes on CPU).
    """

    def __init__(self, target: Target, tokenizer=None, *, drafter: LoadedDrafter | None = None,
                 stop_ids: Sequence[int] | None = None, proposal: Callable | None = None,
                 block_size: int | None = None, mask_token_id: int = 0,
                 buckets: Sequence[int] | None = None, top_k: int = 128,
                 latency: LatencyModel | None = None, draft_vocab: DraftVocab | str | int | None = "auto",
                 lookup: LookupConfig | None = LookupConfig(), datastore: Datastore | str | None = "auto",
                 cond_depths: int | None = None, cond_candidates: int | None = None):
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.proposal = proposal
        if drafter is not None:
            drafter.config.check_pair(target.config)
            block_size = drafter.config.block_size
            mask_token_id = drafter.config.mask_token_id
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        if stop_ids is None:
            from bastion_jax.text import stop_ids as _stop_ids

            stop_ids = _stop_ids(tokenizer, target.config.eos_token_ids)
        self.stop_ids = frozenset(int(s) for s in stop_ids)
        self.buckets = tuple(sorted(set(int(b) for b in (default_buckets() if buckets is None else buckets))))
        limit = target.config.max_position_embeddings
        if self.buckets and self.buckets[-1] > limit:  # its tree's slots alone would outgrow any cache
            raise GenerationError(f"bucket {self.buckets[-1]} exceeds the model's context of {limit} positions "
                                  "(--buckets lists tree sizes: a few nodes to a few hundred)")
        if top_k < 1:  # 0 would build trees of the lookup chain alone, a negative one fail inside top_k
            raise GenerationError(f"tree top-k must be >= 1 (drafter candidates per block position), got {top_k}")
        self.top_k = top_k
        if isinstance(draft_vocab, (str, numbers.Integral)):  # a spec as the CLI's --draft-vocab takes it
            if drafter is not None and proposal is None:
                draft_vocab = resolve_draft_vocab(target, drafter, draft_vocab)
            elif not asks_for_draft_vocab(draft_vocab):  # nothing to restrict, and nothing was asked
                draft_vocab = None
        if draft_vocab is not None and (drafter is None or proposal is not None):
            raise GenerationError("a draft vocabulary restricts a drafter's LM head: it needs a drafter and no proposal")
        if isinstance(draft_vocab, DraftVocab) and draft_vocab.cond_tables is None:
            draft_vocab = draft_vocab.with_head(target, drafter)  # a conditioned head's tables, made once here
        self.draft_vocab = draft_vocab
        has_head = drafter is not None and drafter.config.cond_head_rank > 0
        if cond_depths is None:
            cond_depths = min(default_cond_depths(), block_size - 1) if has_head else 0  # a block of < 5 has fewer depths
        if not 0 <= cond_depths < max(block_size or 0, 1):
            raise GenerationError(f"cond_depths must be in [0, block size - 1 = {(block_size or 1) - 1}], got {cond_depths}")
        no_head = "none is loaded (a drafter ships one as cond_head.json, loaded unless --cond-head off)"
        if cond_depths >= 2 and not has_head:
            raise GenerationError(f"cond_depths draws tree children from a conditioned head; {no_head}")
        self.cond_depths = cond_depths
        if cond_candidates is None:
            cond_candidates = default_cond_candidates() if has_head else 0
        if cond_candidates < 0:
            raise GenerationError(f"cond_candidates must be >= 0 (0: the head corrects every column), got {cond_candidates}")
        if cond_candidates and not has_head:
            raise GenerationError(f"cond_candidates restricts a conditioned head; {no_head}")
        self.cond_candidates = cond_candidates
        self.lookup = lookup
        self.datastore = resolve_datastore(datastore, target, drafter, lookup)
        self.executables = Executables(target, drafter, proposal=proposal, block_size=block_size,
                                       mask_token_id=mask_token_id, buckets=self.buckets, top_k=top_k,
                                       draft_vocab=draft_vocab, lookup=lookup, store=self.datastore,
                                       cond_depths=cond_depths, cond_candidates=cond_candidates)
        # Per batch size and sampling kind (greedy or sampled), the draft gate's estimates, kept across
        # requests: a batch's curves are its last rows' (`controller.batch_curve`), not one row's, and
        # trees accept other lengths under argmax than under samples (rho, A_bar, the probe interval).
        self._gate_memory: dict[tuple[int, bool], dict] = {}
        self.latency = latency or self.default_latency_model()
        self._batch_latency: dict[int, LatencyModel] = {}  # models for other batch sizes than self.latency's
        self.warm: set[tuple[int, bool]] = set()  # (executable id, greedy) run once (`warmup.warm_up`)
        # A step dropped to free memory mappings is no longer warm. (The set, not the engine, is bound:
        # no reference cycle.)
        self.executables.on_evict = partial(warmup.forget, self.warm)
        self.progress = False  # a bar on stderr while a warm-up runs (the CLI's; seconds per step on CPU)

    def latency_for(self, batch: int) -> LatencyModel:
        """The latency model that prices steps of `batch` rows: `self.latency` when it was made (and
        calibrated) for that batch, else one kept per batch size (roofline at that batch + online
        correction: see `LatencyModel.for_batch`)."""
        if batch == getattr(self.latency, "batch", batch) or not hasattr(self.latency, "for_batch"):
            return self.latency  # (a caller's own latency model that does not price batches is used as is)
        if batch not in self._batch_latency or self._batch_latency[batch].peaks != self.latency.peaks:
            self._batch_latency[batch] = self.latency.for_batch(batch)
        return self._batch_latency[batch]

    @property
    def compilations(self) -> int:
        """Steps this engine compiled so far (each shape once; a warm request adds none)."""
        return self.executables.compilations

    def default_latency_model(self) -> LatencyModel:
        bpv = jnp.dtype(self.target.dtype).itemsize
        d = self.drafter
        rows = int(self.draft_vocab.ids.shape[0]) if self.draft_vocab is not None else None
        return LatencyModel(ModelDims.of(self.target.config, bpv), DevicePeaks.detect(), self.buckets,
                            ModelDims.of(d.config, bpv) if d else None, self.block_size or 1, rows)

    @property
    def default_mode(self) -> str:
        """The CLI's default: bastion whenever there is something to draft with, else ar."""
        return "bastion" if self.block_size else "ar"

    def slack(self, mode: str | Policy) -> int:
        """Cache slots a step of `mode` may write past the committed length (the verified block or
        tree, the drafter's buffered features): the cache keeps them free after the last token."""
        kind = (mode if isinstance(mode, Policy) else Policy.parse(mode)).kind
        if kind == "ar":
            return 0
        return (self.block_size or 0) if kind == "dflash" else self.tree_slack()

    def calibrate(self, cache_len: int, sampling: SamplingConfig = SamplingConfig(),
                  contexts: Sequence[int] | None = None, reps: int = warmup.CALIBRATION_REPS,
                  batch: int = 1, prompt_bucket: int = 16,
                  progress: bool = False) -> list[tuple[int | str, int, float]]:
        """Offline calibration (`warmup.calibrate`): time every bucket's step, the root (AR) step with and
        without a draft and the steps that verify a held lookup chain at a few context lengths, with
        `batch` rows, and fit the latency model, which from then on prices steps of that batch.
        `prompt_bucket`: the prefill it starts from (`prefill_bucket` of the request to come: its
        prefill is then compiled once). `progress`: a bar on stderr. Returns the (variant, context,
        seconds) samples."""
        if not 1 <= prompt_bucket <= cache_len:
            raise GenerationError(f"calibration prompt_bucket {prompt_bucket} must lie in [1, {cache_len}] "
                                  "(the cache length)")
        return warmup.calibrate(self, cache_len, sampling, contexts, reps, batch, prompt_bucket, progress)

    def tree_step_buckets(self, kind: str) -> list[int]:
        """The tree steps bastion compiles: not bucket 1 (the root alone runs as a root step that
        drafts, `TreeLoop`), unless there is no drafter, whose drafting root step would price it."""
        if kind == "bastion" and self.drafter is not None and len(self.buckets) > 1:
            return [b for b in self.buckets if b != 1]
        return list(self.buckets)

    def tree_slack(self) -> int:
        """Cache slots a tree-policy step may write past the committed length: the largest bucket
        (verify), and the drafter's feature buffer (a draft injects all of it at once)."""
        block = self.block_size or 0
        return max(max(self.buckets), block, tree_decoding.pending_slots(block) if block else 0)

    def cache_len_for(self, prompt_lens: Sequence[int], max_new_tokens: int, max_len: int | None,
                      slack: int = 0) -> int:
        """The KV cache length that holds the longest prompt + `max_new_tokens` + `slack` (the slots a
        step writes past the committed length): `max_len` if given (an error if it is too small: an
        answer is never cut short silently), else that sum rounded up to a size class
        (`cache_class`) and capped at the model's positions (only speculative slots, never committed
        tokens, may run past them)."""
        longest = max(prompt_lens)
        limit = self.target.config.max_position_embeddings
        need = longest + max_new_tokens + slack
        if max_len is None:
            if longest + max_new_tokens > limit:
                raise GenerationError(
                    f"the prompt ({longest} tokens) + {max_new_tokens} new tokens (--max-new-tokens) = "
                    f"{longest + max_new_tokens} exceed the model's context of {limit} positions; lower "
                    "--max-new-tokens or shorten the prompt")
            return max(need, min(cache_class(need), limit))
        if max_len > limit:
            raise GenerationError(f"--max-len {max_len} exceeds the model's context of {limit} positions")
        if need > max_len:
            raise GenerationError(
                f"the KV cache of --max-len {max_len} slots cannot hold the prompt ({longest} tokens) + "
                f"{max_new_tokens} new tokens (--max-new-tokens) + {slack} slots of draft/tree slack = {need}; "
                "raise --max-len, lower --max-new-tokens, or leave --max-len out (sized to fit)")
        return max_len

    # -- generation --------------------------------------------------------------------------
    def stream(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256,
               sampling: SamplingConfig = SamplingConfig(), seed: int = 0, mode: str | None = None,
               max_len: int | None = None, stats: Stats | None = None) -> Iterator[list[list[int]]]:
        """Yield, after every step, the new tokens of each row (empty for finished rows).

        mode: "ar", "dflash" (top-1 chain), "fixed:N" (always verify an N-node tree) or "bastion"
        (the controller picks the bucket each step); default bastion with a drafter, else ar.
        Every row produces `max_new_tokens` tokens unless it emits a stop token first: the cache is
        sized for that (with `max_len` too small the request is refused), never cut short. Timings in
        `stats` exclude the time the caller holds a yielded step (detokenising, printing).
        """
        try:
            policy = Policy.parse(mode or self.default_mode)
        except PolicyError as e:
            raise GenerationError(str(e)) from None
        if policy.kind != "ar" and not self.block_size:
            raise GenerationError(f"mode {policy} needs a drafter (--drafter DIR)")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise GenerationError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab = self.target.config.vocab_size
        if any(not 0 <= t < vocab for p in prompts for t in p):
            raise GenerationError(f"prompt token id outside the vocabulary [0, {vocab})")
        controller = None
        latency = self.latency_for(len(prompts))  # a step's price depends on how many rows it computes
        if policy.uses_tree:
            try:
                controller = Controller(policy, self.buckets, latency)
            except PolicyError as e:
                raise GenerationError(str(e)) from None
        stats = stats if stats is not None else Stats()
        stats.mode = str(policy)
        batch = len(prompts)
        lens = np.array([len(p) for p in prompts], np.int32)
        slack = self.slack(policy)
        cache_len = self.cache_len_for(lens.tolist(), max_new_tokens, max_len, slack)
        bucket = prefill_bucket(int(lens.max()), cache_len)
        exe = self.executables
        before = exe.compilations
        t0 = time.perf_counter()
        with warmup.progress(self) as bar:  # (a bar on stderr for the CLI: steps lowered, then first runs)
            if policy.uses_tree:
                step_buckets = ([policy.size] if policy.kind == "fixed" else list(controller.paper_buckets)
                                if policy.kind == "bastion-paper" else self.tree_step_buckets(policy.kind))
                prefill, steps = exe.tree(batch, bucket, cache_len, step_buckets)
                gate, roots, chains = None, None, None
                if policy.kind == "bastion":
                    roots = exe.roots(batch, cache_len)
                    chains = exe.chains(batch, cache_len)
                    gate = DraftGate(self.buckets, latency.step_time, tree_decoding.pending_slots(self.block_size),
                                     self.block_size, held_rows=max(chains, default=1))
                    # What the gate learnt of this drafter and text carries over to the next request.
                    gate.restore(self._gate_memory.setdefault((batch, sampling.greedy), {}))
            else:
                prefill, step = (exe.ar if policy.kind == "ar" else exe.chain)(batch, bucket, cache_len)
            # Every executable this request may use runs once now, not inside the timed request.
            used = ([*steps.values(), *(roots or {}).values(), *(chains or {}).values()] if policy.uses_tree
                    else [step])
            warmup.warm_up(self, policy.kind, batch, bucket, cache_len, sampling, prefill, used, bar)
        exe.ready()  # (nothing compiles on a worker thread once the request runs)
        stats.compile_s += time.perf_counter() - t0

        t0 = time.perf_counter()
        compiled_before = compile_counter.compilations()  # (none from here on: the timed request)
        padded = np.zeros((batch, bucket), np.int32)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = p
        rng, prompt_args = warmup.prompt_args(padded, lens, seed, sampling)
        params = prompt_args[2]
        tcache = exe.new_cache(batch, cache_len)
        dstate = exe.drafter_params
        # Every step writes at most `slack` slots past the committed length and cache_len_for made
        # room for all of them after max_new_tokens, so every row may produce its full budget.
        rows = Rows(batch, max_new_tokens, self.stop_ids)
        if policy.kind == "ar":
            tcache, nxt = prefill(exe.target_params, tcache, *prompt_args)
            first = np.asarray(nxt)
        elif policy.kind == "dflash":
            state = prefill(exe.target_params, dstate, tcache, exe.new_drafter_cache(batch, cache_len), *prompt_args)
            first = np.asarray(state.root)
        else:
            state, curve = prefill(exe.target_params, dstate, tcache, exe.new_drafter_cache(batch, cache_len),
                                   *prompt_args)
            # (sliced on the host: an eager slice on the device compiles on a process's first request,
            # ~60-200 ms of its time to first token on CPU)
            first = np.asarray(state.tree.tokens)[:, 0]
        stats.ttft_s += time.perf_counter() - t0
        stats.prompt_tokens += int(lens.sum())
        t1 = time.perf_counter()
        held = 0.0  # seconds the caller held our yielded steps: not the engine's time

        emitted = [rows.take(i, [first[i]]) for i in range(batch)]
        stats.new_tokens += sum(map(len, emitted))
        paused = time.perf_counter()
        yield emitted
        held += time.perf_counter() - paused
        lengths = lens.copy()
        active_dev, active_was = None, None  # the rows' active mask on the device, sent again only when it changes
        # One loop interface for every policy (`loops`, `tree_loop`): the state it carries is the KV
        # cache (AR), the `SpecState` (dflash) or the `TreeState` (tree policies).
        if policy.kind == "ar":
            loop, state = ArLoop(step, exe.target_params, nxt), tcache
        elif policy.kind == "dflash":
            loop = ChainLoop(step, exe.target_params, dstate)
        else:
            loop = TreeLoop(policy.kind, controller, gate, steps, roots, latency, self.buckets,
                            exe.target_params, dstate, curve, chains, self.stop_ids, self.block_size or 0)
        keys = KeyStream(rng) if not sampling.greedy else None  # (greedy steps draw nothing)

        def next_params():
            """The step's sampler with a fresh key; greedy steps keep the request's one."""
            return params if keys is None else params.replace(key=keys.next())

        while not rows.done.all():
            active = ~rows.done
            if active_was is None or not np.array_equal(active, active_was):
                active_dev, active_was = jax.device_put(active), active
            # Some row still has budget after this step: the next step may be dispatched before this
            # one is read (AR always; the tree policies after a root step that does not draft).
            look_ahead = not (rows.done | (rows.produced + 1 >= rows.budget)).all()
            # Every active row still needs a step after this one even if this one commits a whole
            # block (a step commits at most block_size tokens): fixed:N and dflash may dispatch it ahead.
            tree_ahead = bool((rows.done | (rows.produced + (self.block_size or 0) < rows.budget)).all())
            # One device->host read per step (`tree_loop.read` of everything the host needs at once).
            state, toks, counts = loop.step(state, active, active_dev, lengths, next_params, look_ahead, tree_ahead,
                                            rows.budget - rows.produced)
            new = [toks[i, : counts[i]] for i in range(batch)]
            lengths = lengths + np.where(active, counts, 0).astype(np.int32)
            stats.steps += 1
            stats.row_steps += int(active.sum())
            stats.committed += int(counts[active].sum())
            emitted = [rows.take(i, new[i]) for i in range(batch)]
            stats.new_tokens += sum(map(len, emitted))
            paused = time.perf_counter()
            yield emitted
            held += time.perf_counter() - paused
        stats.decode_s += time.perf_counter() - t1 - held
        for why in rows.ended:
            stats.ended[why] = stats.ended.get(why, 0) + 1
        stats.compilations += self.compilations - before
        stats.compilations_after_warmup += compile_counter.compilations() - compiled_before
        if policy.kind == "bastion" and gate is not None:
            self._gate_memory[(batch, sampling.greedy)] = gate.memory()
            stats.chain_steps += gate.chained
        if controller is not None:
            for b, n in controller.histogram.items():
                stats.buckets[b] = stats.buckets.get(b, 0) + n

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> Result:
        """Run `stream` to the end; returns new tokens per prompt and statistics."""
        stats = Stats()
        out: list[list[int]] = [[] for _ in prompts]
        for step in self.stream(prompts, stats=stats, **kwargs):
            for i, toks in enumerate(step):
                out[i].extend(toks)
        return Result(out, stats)
