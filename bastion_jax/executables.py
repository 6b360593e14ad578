"""The compiled steps of one (target, drafter) pair: built once per shape, counted, reused.

`Executables` lowers and compiles each pure step function (`decoding`, `speculative`,
`tree_decoding`) ahead of time (`jit(...).lower(...).compile()`) for the shapes a request needs,
and keeps them in a table keyed by what changes the compiled code (step, sampling, batch, cache
length, buckets, tree width, draft vocabulary size). It counts every compilation it does, so the
engine (and the tests) can prove a second request with the same shapes compiles nothing. The
engine, the profiler and the benchmarks all get their steps here.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from bastion_jax import decoding, speculative, tree_decoding
from bastion_jax.checkpoints import LoadedDrafter, Target
from bastion_jax.modeling.cache import KVCache
from bastion_jax.sampling import SamplingConfig
from bastion_jax.speculative import DraftVocab
from bastion_jax.tree_decoding import DRAFT, FLUSH, HOLD


class Bound:
    """A compiled tree-policy executable with the draft vocabulary bound as its last argument."""

    def __init__(self, exe, draft_vocab: DraftVocab | None):
        self.exe, self.draft_vocab = exe, draft_vocab

    def __call__(self, *args):
        return self.exe(*args, self.draft_vocab)


class Executables:
    """Compiled prefill/step functions for a target (and drafter), one per shape, compiled on first use."""

    def __init__(self, target: Target, drafter: LoadedDrafter | None, *, proposal: Callable | None,
                 block_size: int | None, mask_token_id: int, buckets: tuple[int, ...], top_k: int,
                 draft_vocab: DraftVocab | None):
        self.target, self.drafter, self.proposal = target, drafter, proposal
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.buckets, self.top_k, self.draft_vocab = buckets, top_k, draft_vocab
        self._table: dict[tuple, Any] = {}
        self.compilations = 0  # compilations done so far (a cached shape adds none)

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
    def compiled(self, fn, key: tuple, args: tuple, static: dict):
        """The compiled `fn` for `key`, compiling (and counting) it the first time."""
        exe = self._table.get(key)
        if exe is None:
            exe = fn.lower(*args, **static).compile()
            self._table[key] = exe
            self.compilations += 1
        return exe

    def _static(self, sampling: SamplingConfig) -> dict:
        d = self.drafter
        return dict(target_def=self.target.graphdef, drafter_def=d.graphdef if d else None,
                    sampling=sampling, block_size=self.block_size, mask_token_id=self.mask_token_id,
                    tap_layers=tuple(d.config.target_layer_ids) if d else (), proposal=self.proposal)

    def _tree_static(self, sampling: SamplingConfig) -> dict:
        return dict(self._static(sampling), buckets=self.buckets, top_k=self.top_k)

    # -- per policy ------------------------------------------------------------------------------
    def ar(self, batch: int, bucket: int, cache_len: int, sampling: SamplingConfig):
        """(prefill, decode) of plain AR decoding at these shapes."""
        i32 = jnp.int32
        rows = jax.ShapeDtypeStruct((batch,), i32)
        rng = jax.random.PRNGKey(0)
        tcache = jax.eval_shape(lambda: self.new_cache(batch, cache_len))
        static = dict(graphdef=self.target.graphdef, sampling=sampling)
        prefill = self.compiled(decoding.prefill, ("prefill", "ar", sampling, batch, bucket, cache_len),
                                (self.target.state, tcache, jax.ShapeDtypeStruct((batch, bucket), i32), rows, rng),
                                static)
        step = self.compiled(decoding.decode, ("decode", "ar", sampling, batch, cache_len),  # not per prompt bucket
                             (self.target.state, tcache, rows, rows, rng, jax.ShapeDtypeStruct((batch,), bool)),
                             static)
        return prefill, step

    def chain(self, batch: int, bucket: int, cache_len: int, sampling: SamplingConfig):
        """(prefill, step) of chain speculative decoding (mode dflash) at these shapes."""
        i32 = jnp.int32
        rows = jax.ShapeDtypeStruct((batch,), i32)
        rng = jax.random.PRNGKey(0)
        static = self._static(sampling)
        dstate = self.drafter.state if self.drafter else None
        tcache = jax.eval_shape(lambda: self.new_cache(batch, cache_len))
        dcache = jax.eval_shape(lambda: self.new_drafter_cache(batch, cache_len))
        args = (self.target.state, dstate, tcache, dcache, jax.ShapeDtypeStruct((batch, bucket), i32), rows, rng)
        prefill = self.compiled(speculative.spec_prefill, ("spec_prefill", sampling, batch, bucket, cache_len),
                                args, static)
        state = jax.eval_shape(lambda *a: speculative.spec_prefill(*a, **static), *args)
        step = self.compiled(speculative.spec_step, ("spec_step", sampling, batch, cache_len),
                             (self.target.state, dstate, state, jax.ShapeDtypeStruct((batch,), bool), rng), static)
        return prefill, step

    def _tree_key(self, sampling: SamplingConfig, batch: int, cache_len: int) -> tuple:
        n_draft = None if self.draft_vocab is None else int(self.draft_vocab.ids.shape[0])
        return ("tree", sampling, batch, cache_len, self.buckets, self.top_k, n_draft)

    def _tree_prefill_args(self, batch: int, bucket: int, cache_len: int) -> tuple:
        i32 = jnp.int32
        dstate = self.drafter.state if self.drafter else None
        tcache = jax.eval_shape(lambda: self.new_cache(batch, cache_len))
        dcache = jax.eval_shape(lambda: self.new_drafter_cache(batch, cache_len))
        return (self.target.state, dstate, tcache, dcache, jax.ShapeDtypeStruct((batch, bucket), i32),
                jax.ShapeDtypeStruct((batch,), i32), jax.random.PRNGKey(0), self.draft_vocab)

    def _tree_step_args(self, batch: int, cache_len: int, sampling: SamplingConfig) -> tuple:
        args = self._tree_prefill_args(batch, 16, cache_len)
        state = jax.eval_shape(lambda *a: tree_decoding.tree_prefill(*a, **self._tree_static(sampling))[0], *args)
        return (self.target.state, args[1], state, jax.ShapeDtypeStruct((batch,), bool), args[6], self.draft_vocab)

    def tree(self, batch: int, bucket: int, cache_len: int, sampling: SamplingConfig, step_buckets: Sequence[int]):
        """(prefill, {bucket: step}) of the tree policies. The callables bind the draft vocabulary; a
        step takes an optional `then` (default: draft the next tree)."""
        static = self._tree_static(sampling)
        key = self._tree_key(sampling, batch, cache_len)
        prefill = self.compiled(tree_decoding.tree_prefill, key + ("prefill", bucket),
                                self._tree_prefill_args(batch, bucket, cache_len), static)
        step_args = self._tree_step_args(batch, cache_len, sampling)
        steps = {b: Bound(self.compiled(tree_decoding.tree_step, key + ("step", b), step_args,
                                        dict(static, bucket=b)), self.draft_vocab)
                 for b in step_buckets}
        return Bound(prefill, self.draft_vocab), steps

    def roots(self, batch: int, cache_len: int, sampling: SamplingConfig) -> dict[int, Bound]:
        """{then: root step}: the AR step of the tree policies (hold, draft or flush after it)."""
        static = self._tree_static(sampling)
        key = self._tree_key(sampling, batch, cache_len)
        step_args = self._tree_step_args(batch, cache_len, sampling)
        return {then: Bound(self.compiled(tree_decoding.root_step, key + ("root", then), step_args,
                                          dict(static, then=then)), self.draft_vocab)
                for then in (HOLD, DRAFT, FLUSH)}

    def tree_parts(self, batch: int, cache_len: int, step_buckets: Sequence[int]):
        """({bucket: tree_verify}, tree_draft): the two halves of a tree step on their own, so the
        profiler can time them apart."""
        lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
        static = self._tree_static(SamplingConfig())
        args = self._tree_prefill_args(batch, 16, cache_len)
        tree = jax.eval_shape(lambda *a: tree_decoding.tree_prefill(*a, **static)[0], *args).tree
        tcache, dcache = args[2], args[3]
        key = ("tree_parts", batch, cache_len, self.buckets, self.top_k)
        verify = {b: self.compiled(tree_decoding.tree_verify, key + ("verify", b),
                                   (self.target.state, tcache, tree, lengths),
                                   dict(bucket=b, target_def=self.target.graphdef, tap_layers=static["tap_layers"]))
                  for b in step_buckets}
        features = jax.ShapeDtypeStruct(self.feature_shape(batch), self.feature_dtype)
        draft_static = {k: static[k] for k in ("target_def", "drafter_def", "block_size", "mask_token_id",
                                               "proposal", "buckets", "top_k")}
        draft = self.compiled(tree_decoding.tree_draft, key + ("draft",),
                              (self.target.state, args[1], dcache, features, lengths, lengths, lengths), draft_static)
        return verify, draft
