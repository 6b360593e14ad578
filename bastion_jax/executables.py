"""The compiled steps of one (target, drafter) pair: built once per shape, counted, reused.

`Executables` lowers and compiles each pure step function (`decoding`, `speculative`,
`tree_decoding`) ahead of time (`jit(...).lower(...).compile()`) for the shapes a request needs,
and keeps them in a table keyed by what changes the compiled code (step, batch, cache
length, buckets, tree width, draft vocabulary size, context lookup, datastore size). It counts every compilation it
does, so the engine (and the tests) can prove a second request with the same shapes compiles nothing. The
engine, the profiler and the benchmarks all get their steps here.
"""

from __future__ import annotations

import functools
import gc
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bastion_jax import decoding, speculative, tree_decoding
from bastion_jax.modeling.cond_head import HeadTables, embed_table, head_table
from bastion_jax.checkpoints import LoadedDrafter, Target
from bastion_jax.compiling import Compiling, compile_async
from bastion_jax.datastore import Datastore
from bastion_jax.lookup import LookupConfig
from bastion_jax.modeling.cache import KVCache
from bastion_jax.sampling import SamplingConfig, sampler
from bastion_jax.speculative import DraftVocab
from bastion_jax.step_config import StepConfig
from bastion_jax.tree_decoding import DRAFT, FLUSH, HOLD


class FlatParams(dict):
    """A model's parameters as the plain nested dict the steps take (`nnx.merge` reads it), which JAX
    flattens in one step: the leaves are listed once, here, and handed over as a tuple, with the
    rank <= 1 leaves (norm scales, biases) packed into one vector per dtype that the step slices
    apart (static slices, fused into their consumers).

    Why: every argument of a compiled call costs the host some CPU time (its signature, layout and
    buffer hold; more once a step has streamed the weights through the CPU's caches), and the host's
    turn is the device's idle time between bastion's tree steps. A nested dict also cost a sort of
    each level's keys per call: at SmolLM2's 272 target leaves ~0.6 ms as dicts, ~0.4 ms as one
    node (a no-op executable with those arguments, 2-core EPYC, 2026-12-06). Packing its 61 norm
    scales (and the drafter's 11 small leaves) takes a bucket-4 tree step from ~300 arguments to
    ~230, and the host's median CPU time per loop iteration from 1.37 / 1.46 / 1.82 ms to 1.34 /
    1.43 / 1.44 ms (three alternations, the packed run second each time, while the machine slowed:
    `benchmarks/results/cpu-smollm2-host-pack-2026-12-06.md`): small, but on every step.
    Matrices stay separate: XLA:CPU copies a slice of a stacked matrix before its product.
    A snapshot: it refuses to be changed in place (its leaves are listed once), and copies and
    pickles rebuild it from its items."""

    def __init__(self, tree: dict, _flat: tuple | None = None):
        super().__init__(tree)
        self._flat = _flat if _flat is not None else _pack(*jax.tree.flatten(dict(tree)))

    def _frozen(self, *args, **kwargs):
        raise TypeError("FlatParams is a snapshot of a model's parameters: build a new one instead")

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _frozen

    def __reduce__(self):
        return FlatParams, (dict(self),)


def _pack(leaves: list, treedef) -> tuple[tuple, tuple]:
    """(children, aux) of a `FlatParams`: the matrices in tree order, then one vector per dtype
    holding the rank <= 1 leaves end to end; aux = (treedef, groups), a group = (dtype, ((leaf
    index, offset, shape), ...))."""
    small: dict[np.dtype, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if leaf.ndim <= 1:
            small.setdefault(np.dtype(leaf.dtype), []).append(i)
    packed = {i for idx in small.values() for i in idx}
    children = [leaf for i, leaf in enumerate(leaves) if i not in packed]
    groups = []
    for dtype, idx in small.items():
        offsets = np.cumsum([0] + [int(leaves[i].size) for i in idx])
        groups.append((dtype, tuple((i, int(at), tuple(leaves[i].shape)) for i, at in zip(idx, offsets))))
        children.append(jnp.concatenate([jnp.ravel(leaves[i]) for i in idx]))  # [sum of sizes]
    return tuple(children), (treedef, tuple(groups))


def _unpack(aux: tuple, children: tuple) -> FlatParams:
    """The `FlatParams` of `children`: arrays and tracers (inside a step) slice the packed vectors
    apart; a placeholder JAX puts in their stead (an abstract value, a sharding) stands for each of
    the leaves it packs."""
    treedef, groups = aux
    n_matrices = len(children) - len(groups)
    leaves: list = [None] * treedef.num_leaves
    small = {i for _, offsets in groups for i, _, _ in offsets}
    matrices = iter(children[:n_matrices])
    for i in range(treedef.num_leaves):
        if i not in small:
            leaves[i] = next(matrices)
    for (_, offsets), packed in zip(groups, children[n_matrices:]):
        for i, at, shape in offsets:
            if isinstance(packed, (jax.Array, np.ndarray)):  # (tracers are jax.Arrays)
                leaves[i] = packed[at:at + math.prod(shape)].reshape(shape)
            elif isinstance(packed, jax.ShapeDtypeStruct):
                leaves[i] = jax.ShapeDtypeStruct(shape, packed.dtype)
            else:
                leaves[i] = packed
    return FlatParams(jax.tree.unflatten(treedef, leaves), (tuple(children), aux))


jax.tree_util.register_pytree_node(FlatParams, lambda p: p._flat, _unpack)


class Bound:
    """A compiled tree-policy executable with its last arguments bound (the draft vocabulary, and for
    the steps that run the lookup the datastore)."""

    def __init__(self, exe, *bound):
        self.exe, self.bound = exe, bound

    def __call__(self, *args):
        return self.exe(*args, *self.bound)


@functools.cache
def _sampler():
    """The abstract `Sampler` argument of every step (greedy or not is a traced value in it); traced
    once (~0.6 ms each time on CPU, and every request asks for it)."""
    return jax.eval_shape(lambda: sampler(jax.random.PRNGKey(0), SamplingConfig()))


# Of the process's memory-mapping limit, the share compiled steps may fill before the least recently
# used ones are dropped (`Executables.make_room`).
MAPPINGS_SHARE = 0.7
STEP_MAPPINGS = 500  # the least a step is taken to map (before any has been compiled, a guess on the low side)


def mappings() -> int:
    """The process's memory mappings now (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def mapping_budget() -> int | None:
    """How many mappings the process may hold before `Executables` drops old steps: `MAPPINGS_SHARE` of
    Linux's per-process limit (vm.max_map_count, 65,530 by default); None where there is none to read."""
    try:
        return int(int(Path("/proc/sys/vm/max_map_count").read_text()) * MAPPINGS_SHARE)
    except (OSError, ValueError):
        return None


class Executables:
    """Compiled prefill/step functions for a target (and drafter), one per shape, compiled on first use."""

    def __init__(self, target: Target, drafter: LoadedDrafter | None, *, proposal: Callable | None,
                 block_size: int | None, mask_token_id: int, buckets: tuple[int, ...], top_k: int,
                 draft_vocab: DraftVocab | None, lookup: LookupConfig | None = None,
                 store: Datastore | None = None, cond_depths: int = 0, cond_candidates: int = 0):
        self.target, self.drafter, self.proposal, self.lookup = target, drafter, proposal, lookup
        self.store = store  # (a datastore serves the lookup: `datastore.resolve_datastore` refuses it without)
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.buckets, self.top_k, self.draft_vocab = buckets, top_k, draft_vocab
        self.cond_depths, self.cond_candidates = cond_depths, cond_candidates
        # The steps take plain nested dicts of arrays: flattening an `nnx.State` (nested State nodes
        # flattened in Python) costs ~0.5 ms per call at SmolLM2's 272 leaves, 3% of a CPU decode step,
        # and a nested dict ~0.2 ms more than `FlatParams`.
        self.target_params = FlatParams(nnx.to_pure_dict(target.state))
        self.drafter_params = FlatParams(nnx.to_pure_dict(drafter.state)) if drafter is not None else None
        self._table: dict[tuple, Any] = {}
        self._step_args: dict[tuple, tuple] = {}  # abstract tree-step arguments per shape
        self._config: StepConfig | None = None  # made once (`config`)
        self._full_tables = None  # a conditioned head's full-vocabulary tables (`_chain_tables`), once asked for
        self.compilations = 0  # compilations done so far (a cached shape adds none)
        self.on_lower: Callable[[], object] | None = None  # called after each new step is lowered (a progress bar)
        self.mapping_budget = mapping_budget()  # (None: never drop steps)
        self._maps_at_start = mappings()  # what the process held before any of these steps
        self.evictions = 0  # steps dropped to stay under it (`make_room`)
        self.on_evict: Callable[[Any], object] | None = None  # called with each step dropped (the engine's warm set)

    # -- buffers ---------------------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.create(self.target.config, batch, max_len, self.target.dtype)

    def new_drafter_cache(self, batch: int, max_len: int) -> KVCache:
        if self.drafter is None:
            return KVCache(k=(), v=())
        dtype = self.drafter.state["norm"]["weight"][...].dtype
        return KVCache.create(self.drafter.config, batch, max_len, dtype)

    def feature_shape(self, batch: int) -> tuple[int, int, int]:
        """[batch, block_size, F]: the features a step injects into the drafter (F = taps x hidden)."""
        d = self.drafter
        width = len(d.config.target_layer_ids) * self.target.config.hidden_size if d else 1
        return (batch, self.block_size, width)

    @property
    def feature_dtype(self) -> jnp.dtype:
        return self.target.dtype if self.drafter else jnp.dtype(jnp.float32)

    # -- the table -------------------------------------------------------------------------------
    def compiled(self, fn, key: tuple, args: tuple, static: dict | None = None) -> Compiling:
        """The compiled `fn(*args, **static)` for `key`, compiling (and counting) it the first time:
        lowered here, compiled on a worker thread (`Compiling`: the first call waits for it)."""
        exe = self._table.pop(key, None)
        if exe is None:
            self.make_room()
            exe = compile_async(fn.lower(*args, **(static or {})))
            self.compilations += 1
            if self.on_lower is not None:
                self.on_lower()
        self._table[key] = exe  # the most recently used last
        return exe

    def make_room(self) -> None:
        """Before a new step is compiled: drop the least recently used steps while the process would
        hold more memory mappings than `mapping_budget` with it. Why: XLA:CPU maps each compiled
        executable's kernels into the process, three mappings per kernel (~2,100 for one SmolLM2 bastion
        step, ~10 steps per batch size and cache length), and Linux allows 65,530 per process by default:
        a bastion process that had served prompts of four cache sizes aborted inside LLVM on its next
        compile ("Unable to allocate section memory"). A step costs what the steps held cost on average
        (those still compiling count too: near the budget they are waited for first). A dropped step is
        compiled again (or loaded from JAX's persistent cache) when a later request needs it; a request
        running holds its own steps until it ends."""
        if self.mapping_budget is None:
            return
        done = [e for e in self._table.values() if e.done()]
        now = mappings()
        per_step = max(STEP_MAPPINGS, (now - self._maps_at_start) / len(done)) if done else STEP_MAPPINGS
        if now + (len(self._table) - len(done) + 1) * per_step <= self.mapping_budget:
            return
        self.ready()  # the steps still compiling map their kernels first
        while self._table and mappings() + per_step > self.mapping_budget:
            exe = self._table.pop(next(iter(self._table)))
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(exe)
            del exe
            # JAX's own compilation cache holds every executable it compiled too: cleared, so that the
            # dropped one goes (other jitted functions of the process compile again on their next call).
            jax.clear_caches()
            gc.collect()  # (an executable in a reference cycle keeps its mappings until collected)

    def ready(self) -> None:
        """Wait until every step asked for so far is compiled (what a compile time or a count of the
        compilations made later must not leave running)."""
        for exe in list(self._table.values()):
            exe.result()

    def config(self) -> StepConfig:
        """The static part of every step for this pair (one object, so table lookups hit by identity
        instead of comparing graph definitions)."""
        cfg = self._config
        if cfg is None:
            cfg = self._config = StepConfig.of(
                self.target, self.drafter, buckets=self.buckets, top_k=self.top_k,
                proposal=self.proposal, block_size=self.block_size, mask_token_id=self.mask_token_id,
                lookup=self.lookup, cond_depths=self.cond_depths, cond_candidates=self.cond_candidates)
        return cfg

    @property
    def _n_draft(self) -> int | None:
        return None if self.draft_vocab is None else int(self.draft_vocab.ids.shape[0])

    @property
    def _n_store(self) -> int | None:
        return None if self.store is None else int(self.store.tokens.shape[0])

    # -- per policy ------------------------------------------------------------------------------
    def ar(self, batch: int, bucket: int, cache_len: int):
        """(prefill, decode) of plain AR decoding at these shapes."""
        cfg = self.config()
        i32 = jnp.int32
        rows = jax.ShapeDtypeStruct((batch,), i32)
        rng = _sampler()
        tcache = jax.eval_shape(lambda: self.new_cache(batch, cache_len))
        prefill = self.compiled(decoding.prefill, ("prefill", cfg, batch, bucket, cache_len),
                                (cfg, self.target_params, tcache, jax.ShapeDtypeStruct((batch, bucket), i32), rows, rng))
        return prefill, self.decode(batch, cache_len)

    def decode(self, batch: int, cache_len: int):
        """AR's one-token step alone (not per prompt bucket: every `ar` of these shapes shares it)."""
        cfg = self.config()
        rows = jax.ShapeDtypeStruct((batch,), jnp.int32)
        rng = _sampler()
        tcache = jax.eval_shape(lambda: self.new_cache(batch, cache_len))
        return self.compiled(decoding.decode, ("decode", cfg, batch, cache_len),
                             (cfg, self.target_params, tcache, rows, rows, rng, jax.ShapeDtypeStruct((batch,), bool)))

    def forward(self, batch: int, cache_len: int, t: int):
        """The plain t-token causal forward (`decoding.forward`): the profiler's yardstick for verify(t)."""
        cfg = self.config()
        rows = jax.ShapeDtypeStruct((batch,), jnp.int32)
        tcache = jax.eval_shape(lambda: self.new_cache(batch, cache_len))
        return self.compiled(decoding.forward, ("forward", cfg, batch, cache_len, t),
                             (cfg, self.target_params, tcache, jax.ShapeDtypeStruct((batch, t), jnp.int32), rows))

    def _prefill_args(self, cfg: StepConfig, batch: int, bucket: int, cache_len: int) -> tuple:
        i32 = jnp.int32
        dstate = self.drafter_params
        tcache = jax.eval_shape(lambda: self.new_cache(batch, cache_len))
        dcache = jax.eval_shape(lambda: self.new_drafter_cache(batch, cache_len))
        return (cfg, self.target_params, dstate, tcache, dcache, jax.ShapeDtypeStruct((batch, bucket), i32),
                jax.ShapeDtypeStruct((batch,), i32), _sampler(), self.draft_vocab,
                self.store)

    def chain(self, batch: int, bucket: int, cache_len: int):
        """(prefill, step) of chain speculative decoding (mode dflash) at these shapes."""
        cfg = self.config()
        tables = self._chain_tables()
        extra = (None, tables) if tables is not None else ()  # (draft vocabulary, the head's full-vocabulary tables)
        args = self._prefill_args(cfg, batch, bucket, cache_len)[:-2] + extra  # (the chain drafts over every token)
        prefill = self.compiled(speculative.spec_prefill, ("spec_prefill", cfg, batch, bucket, cache_len), args)
        state = jax.eval_shape(lambda *a: speculative.spec_prefill(cfg, *a), *args[1:])
        step = self.compiled(speculative.spec_step, ("spec_step", cfg, batch, cache_len),
                             (cfg, self.target_params, args[2], state, jax.ShapeDtypeStruct((batch,), bool), args[7])
                             + extra)
        return (Bound(prefill, *extra), Bound(step, *extra)) if extra else (prefill, step)

    def _chain_tables(self):
        """A conditioned head's tables over the full vocabulary (`cond_head.HeadTables`), made once:
        the chain drafts over every token, so no draft vocabulary carries them (None without a head)."""
        if self.drafter is None or not self.drafter.config.cond_head_rank or self.proposal is not None:
            return None
        if self._full_tables is None:
            target = nnx.merge(self.target.graphdef, self.target.state)
            head = nnx.merge(self.drafter.graphdef, self.drafter.state).cond_head
            shared = self.draft_vocab.cond_tables if self.draft_vocab is not None else None
            embed = shared.embed if shared is not None else embed_table(head, target.embed_tokens.weight[...])
            # [vocab, rank] each, once (eagerly: one product each; the embedding's shared with the trees')
            self._full_tables = HeadTables(head_table(head, target.logits), embed)
        return self._full_tables

    def _tree_step_args(self, cfg: StepConfig, batch: int, cache_len: int) -> tuple:
        """Abstract arguments of a tree/root step; traced once per shape (tracing a prefill costs ~30 ms
        per request on CPU otherwise)."""
        key = (cfg, batch, cache_len, self._n_draft, self._n_store)
        if key not in self._step_args:
            args = self._prefill_args(cfg, batch, 16, cache_len)
            state = jax.eval_shape(lambda *a: tree_decoding.tree_prefill(cfg, *a)[0], *args[1:])
            self._step_args[key] = (cfg, self.target_params, args[2], state, jax.ShapeDtypeStruct((batch,), bool),
                                    args[7], self.draft_vocab, self.store)
        return self._step_args[key]

    def tree(self, batch: int, bucket: int, cache_len: int, step_buckets: Sequence[int]):
        """(prefill, {bucket: step}) of the tree policies. The callables bind the draft vocabulary; a
        step takes an optional `then` (default: draft the next tree)."""
        cfg = self.config()
        prefill = self.compiled(tree_decoding.tree_prefill,
                                ("tree_prefill", cfg, batch, bucket, cache_len, self._n_draft, self._n_store),
                                self._prefill_args(cfg, batch, bucket, cache_len))
        step_args = self._tree_step_args(cfg, batch, cache_len)
        steps = {b: Bound(self.compiled(tree_decoding.tree_step, ("tree_step", cfg, batch, cache_len, self._n_draft,
                                                                  self._n_store, b),
                                        step_args, dict(bucket=b)), self.draft_vocab, self.store)
                 for b in step_buckets}
        return Bound(prefill, self.draft_vocab, self.store), steps

    def roots(self, batch: int, cache_len: int) -> dict[int, Bound]:
        """{then: root step}: the AR step of the tree policies (hold, draft or flush after it)."""
        cfg = self.config()
        step_args = self._tree_step_args(cfg, batch, cache_len)
        return {then: Bound(self.compiled(tree_decoding.root_step,
                                          ("root_step", cfg, batch, cache_len, self._n_draft, self._n_store, then),
                                          step_args, dict(then=then)), self.draft_vocab, self.store)
                for then in (HOLD, DRAFT, FLUSH)}

    def chains(self, batch: int, cache_len: int) -> dict[int, Bound]:
        """{bucket: tree step that holds after it} for the buckets a lookup chain fills (2..block size):
        bastion verifies a held chain with these without drafting. Empty when lookup is off."""
        if self.lookup is None:
            return {}
        cfg = self.config()
        step_args = self._tree_step_args(cfg, batch, cache_len)
        return {b: Bound(self.compiled(tree_decoding.tree_step, ("tree_step", cfg, batch, cache_len, self._n_draft,
                                                                 self._n_store, b, HOLD),
                                       step_args, dict(bucket=b, then=HOLD)),
                         self.draft_vocab, self.store)
                for b in self.buckets if 1 < b <= self.block_size}

    def tree_struct(self, batch: int, cache_len: int):
        """The abstract `Tree` of the tree steps at these shapes (the step arguments' state: traced once)."""
        return self._tree_step_args(self.config(), batch, cache_len)[3].tree

    def verify_steps(self, batch: int, cache_len: int, step_buckets: Sequence[int]):
        """{bucket: tree_verify}: the target's half of a tree step alone (greedy), called as
        `(target_params, target_cache, tree, lengths)`; compiles neither the drafter nor tree_prefill."""
        cfg = self.config()
        lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
        tcache = jax.eval_shape(lambda: self.new_cache(batch, cache_len))
        tree = self.tree_struct(batch, cache_len)
        return {b: self.compiled(tree_decoding.tree_verify, ("tree_verify", cfg, batch, cache_len, b),
                                 (cfg, self.target_params, tcache, tree, lengths), dict(bucket=b))
                for b in step_buckets}

    def tree_parts(self, batch: int, cache_len: int, step_buckets: Sequence[int]):
        """({bucket: tree_verify}, tree_draft): the two halves of a tree step on their own, so the
        profiler can time them apart (greedy; the draft over the engine's draft vocabulary, bound)."""
        cfg = self.config()
        lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
        args = self._prefill_args(cfg, batch, 16, cache_len)
        dcache = args[4]
        verify = self.verify_steps(batch, cache_len, step_buckets)
        features = jax.ShapeDtypeStruct(self.feature_shape(batch), self.feature_dtype)
        draft = self.compiled(tree_decoding.tree_draft, ("tree_draft", cfg, batch, cache_len, self._n_draft),
                              (cfg, self.target_params, args[2], dcache, features, lengths, lengths, lengths,
                               self.draft_vocab))
        return verify, Bound(draft, self.draft_vocab)
