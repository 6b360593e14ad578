"""The host side of a tree policy's step: what to run, dispatching it, one read, and the feedback.

Each step is either a tree step of bucket b (verify the drafted tree, draft the next one) or a root
step (a plain AR step on the target that then holds, drafts or flushes: `draft_gate`). After the
single device->host read, what the step showed goes back to the latency model (its measured time),
the draft gate (realised acceptance, the fresh tree's surrogate curve) and the controller's
histogram.

Verifying the lookup chain. A step that did not draft leaves the root and the context lookup's
chain as the tree in hand, and its curve as `hint`. The gate may then verify that chain with a
tree step of a small bucket instead of a root step (`DraftGate.chain_bucket`): one that holds
after it (`chains`) or, when the gate drafts, one that drafts (`steps`). Such a step commits a
variable number of tokens and is chosen on the chain just read, so nothing goes ahead of it.

A batch. The engine's rows share every step and a request ends with its last row, so the gate and
the controller judge a tree by the rows that may be last after the step (fewer than a block ahead of
the one with most tokens still to emit, `controller.last_rows`): by the least of their surrogate
curves (`controller.batch_curve`), not the rows' mean. With the mean a batch of mixed prompts drafted
for its predictable rows while its hard ones, a token per step, set the number of steps (8 prompts,
chat and gsm8k, CPU: 0.79-0.88x AR). rho stays the drafter's calibration: the rows' mean realised
over their mean surrogate, at any batch size. One row: its own numbers, as before.

Lookahead. The next step goes out before the host's bookkeeping, the engine's emission and the
caller's streaming, so the device is busy while they run. Where it is known before this step is
read, it goes out before the read: a root step that does not draft commits exactly one token per
active row and leaves no tree to choose from, so the next step is another root step, whose `then`
the gate decides on the context one token further (as the AR loop does); under fixed:N the next
step is always the same tree step. Otherwise (bastion after a tree, a drafting root step or a held
chain: the next bucket is chosen on the curve the read brings) it goes out right after the read and
the loop's own bookkeeping, chosen exactly as the next call would choose it. Either way only while
every active row has room for a whole step more (`tree_ahead`; one token more for a root step
ahead of its read, `look_ahead`); a step that ends a row on a stop id sends nothing after its read,
and one dispatched before its predecessor's read that meets a stopped row computes it once more and
drops its tokens. Nor does a root step go ahead of its predecessor's read when the chain read last
would be worth verifying: the next step is then chosen on the chain this one finds. (Choosing on the
device instead, with `lax.switch` between a root step and chain steps, was tried: XLA copies every
state buffer into and out of a conditional, the KV cache included, which doubled a root step's time
on CPU.)
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Collection, NamedTuple

import jax
import numpy as np

from bastion_jax.controller import Controller, batch_curve, last_rows
from bastion_jax.draft_gate import DraftGate
from bastion_jax.latency import AR, AR_DRAFT, LatencyModel, held
from bastion_jax.tree_decoding import DRAFT, HOLD


@functools.cache
def _host_is_device() -> bool:
    return jax.default_backend() == "cpu"


def read(*arrays) -> tuple[np.ndarray, ...]:
    """The host copies of a step's outputs: the loop's one device->host read. On an accelerator every
    copy is started before any is awaited, as `jax.device_get` does. On CPU, where the arrays are host
    memory already, `np.asarray` on each and nothing else: `jax.device_get`'s generic Python path (and
    `copy_to_host_async`) cost ~0.1-0.2 ms a call once the step before has evicted them from the
    CPU's caches (three small arrays: 0.04 ms against 0.18 ms), about 0.5% of a SmolLM2 tree step."""
    if not _host_is_device():
        for a in arrays:
            a.copy_to_host_async()
    return tuple(np.asarray(a) for a in arrays)


class Dispatched(NamedTuple):
    """A step on its way: what the host needs to read it and learn from it."""

    bucket: int  # the bucket verified (0: a root step)
    then: int
    out: Any
    curve: Any
    at: float  # when it was dispatched
    chain: bool = False  # a tree step verifying the held lookup chain
    early: bool = False  # dispatched before its predecessor was read (the device starts it when that ends)
    predicted: float = 0.0  # a held chain's step: the accepted tokens its curve promised at this bucket


class TreeLoop:
    """Runs the steps of one request under a tree policy (fixed:N, bastion, bastion-paper).

    steps: bucket -> compiled tree step; roots: then -> compiled root step (bastion only, with `gate`);
    curve: the prefill's surrogate curves [batch, n_buckets] (what the first tree offers); chains:
    bucket -> tree step that holds after it (bastion with lookup: verify a held chain, no draft).
    """

    def __init__(self, kind: str, controller: Controller, gate: DraftGate | None, steps: dict, roots: dict | None,
                 latency: LatencyModel, buckets: tuple[int, ...], target_params, drafter_params, curve,
                 chains: dict | None = None, stop_ids: Collection[int] = (), block_size: int = 0):
        self.kind, self.controller, self.gate = kind, controller, gate
        self.stop_ids = np.fromiter(stop_ids, np.int64)
        self.steps, self.roots, self.latency, self.buckets = steps, roots, latency, buckets
        self.chains = chains or {}
        self.params = (target_params, drafter_params)
        self.curve = np.asarray(curve)  # [batch, n_buckets]
        self.remaining: np.ndarray | None = None  # [batch] tokens each row may still emit (`step`)
        self.block_size = block_size  # the most tokens a step commits per row (`last_rows`; 0: every row counts)
        if gate is not None:
            gate.observe_tree(batch_curve(self.curve, np.ones(len(self.curve), bool)))
        self.holding = False  # the last step did not draft: no tree in hand, the next step is a root step
        self.hint: np.ndarray | None = None  # the lookup chain's curve after the last step that did not draft
        self.hint_mean: np.ndarray | None = None  # the same, the active rows' mean (what chain_rho learns on)
        self.queued: Dispatched | None = None  # a step dispatched ahead
        self.log_probs: np.ndarray | None = None  # bastion-paper: the last read tree's log path probabilities
        self.back_at = 0.0  # when the host last came back to the loop (its reads are timed from there)

    def _dispatch_root(self, then: int, state, active_dev, key, early: bool = False) -> tuple[Any, Dispatched]:
        ts = time.perf_counter()
        state, out, curve = self.roots[then](*self.params, state, active_dev, key)
        return state, Dispatched(0, then, out, curve, ts, early=early)

    def _dispatch_tree(self, b: int, state, active_dev, key, then: int = DRAFT, chain: bool = False,
                       early: bool = False) -> tuple[Any, Dispatched]:
        ts = time.perf_counter()
        state, out, curve = (self.steps if then == DRAFT else self.chains)[b](*self.params, state, active_dev, key)
        predicted = float(self.hint_mean[self.buckets.index(b)]) if chain else 0.0
        return state, Dispatched(b, then, out, curve, ts, chain, early, predicted)

    def _chain_bucket(self, context: int, then: int) -> int:
        """The bucket of a step verifying the held lookup chain (0: a root step), judged on the last
        chain read (`hint`, None unless the last step read did not draft)."""
        return self.gate.chain_bucket(context, self.hint, then) if self.chains else 0

    def _dispatch_holding(self, context: int, state, active_dev, key, ahead: bool) -> tuple[Any, Dispatched]:
        """The step for a state holding no draft: a root step that holds, drafts or flushes, or (on a
        fresh read, `ahead` False) the held chain's tree step when that pays."""
        then = self.gate.root_then(context, self.hint)
        b = 0 if ahead else self._chain_bucket(context, then)
        if b:
            return self._dispatch_tree(b, state, active_dev, key, then, chain=True)
        return self._dispatch_root(then, state, active_dev, key, early=ahead)

    def _dispatch_next(self, context: int, state, active: np.ndarray, active_dev, key) -> tuple[Any, Dispatched]:
        """The step chosen on what the last read showed: the tree in hand at the controller's bucket, a
        root step when drafting does not pay (or the best bucket is the root alone), or, holding no
        tree, `_dispatch_holding`'s choice."""
        gate, ctl = self.gate, self.controller
        if self.holding:
            return self._dispatch_holding(context, state, active_dev, key, ahead=False)
        a = self.curve
        last = last_rows(active, self.remaining, self.block_size)
        if gate is not None and (not gate.use_tree(context, batch_curve(a, last))
                                 or ctl.choose(a * gate.rho, context, last, record=False) == 1):
            # A plain AR step on the root (the tree in hand is dropped: drafting does not pay, or the
            # best bucket is the root alone, which a root step verifies without drafting).
            return self._dispatch_root(gate.root_then(context, self.hint), state, active_dev, key)
        probs = None
        if self.kind == "bastion-paper":  # the drafted tree's path probabilities, read with the step's outputs
            lp = self.log_probs if self.log_probs is not None else np.asarray(state.tree.log_probs)  # (prefill's)
            probs, self.log_probs = np.exp(lp), None
        b = ctl.choose(a * (gate.rho if gate else 1.0), context, last if self.kind == "bastion" else active, probs,
                       record=False)
        return self._dispatch_tree(b, state, active_dev, key)

    def _stopped(self, toks: np.ndarray, counts: np.ndarray, active: np.ndarray) -> bool:
        """Some active row committed a stop id in this step (the engine will end it)."""
        if not self.stop_ids.size:
            return False
        new = np.arange(toks.shape[1]) < counts[:, None]  # [batch, n] the committed tokens
        return bool((np.isin(toks, self.stop_ids) & new)[active].any())

    def step(self, state, active: np.ndarray, active_dev, lengths: np.ndarray, next_key: Callable[[], Any],
             look_ahead: bool, tree_ahead: bool = False, remaining: np.ndarray | None = None
             ) -> tuple[Any, np.ndarray, np.ndarray]:
        """One step for the rows in `active` at committed lengths `lengths` [batch] (the longest active
        row is the context the latency model prices). next_key() gives the sampler of the step it is
        called for. `look_ahead`: a further step may still be needed (not every row is at its budget).
        `tree_ahead`: every active row has room for a whole tree step after this one (the next step
        may then go out before this call returns). `remaining` [batch]: the tokens each row may still
        emit (None: every row counts), which say which rows may end the batch (`last_rows`). Returns (state,
        tokens [batch, n], counts [batch])."""
        gate, ctl = self.gate, self.controller
        self.remaining = remaining
        self.back_at = time.perf_counter()
        context = int(lengths[active].max())
        recorded = False  # the gate recorded this step already (when it dispatched the next one)
        timed = True  # the read below times the step (False: it may have ended while the host was away)
        if self.queued is not None:
            cur, self.queued = self.queued, None
            # A step sent after its predecessor's read that is done before the host is back ran for an
            # unknown part of the host's absence: its read would price the host's time as the bucket's.
            timed = cur.early or not cur.out.count.is_ready()
        else:
            state, cur = self._dispatch_next(context, state, active, active_dev, next_key())
        # Ahead of the read: a root step that does not draft commits exactly one token per row, and the
        # next step is a root step whatever this one shows, unless the chain read last may be worth
        # verifying; fixed:N's next step is the same tree step.
        if (look_ahead and cur.bucket == 0 and cur.then != DRAFT
                and not self._chain_bucket(context + 1, HOLD)):
            gate.record(cur.then, 1)
            recorded = True
            state, self.queued = self._dispatch_holding(context + 1, state, active_dev, next_key(), ahead=True)
        elif tree_ahead and self.kind == "fixed":
            state, self.queued = self._dispatch_tree(cur.bucket, state, active_dev, next_key(), early=True)
        # bastion-paper sizes the next tree by the tree this step drafted: its path probabilities come in
        # the same read (nothing goes ahead of a bastion-paper read, so `state` is this step's).
        paper = (state.tree.log_probs,) if self.kind == "bastion-paper" else ()
        toks, counts, new_curve, *lp = read(cur.out.tokens, cur.out.count, cur.curve, *paper)
        self.log_probs = lp[0] if lp else None
        # A step dispatched before its predecessor was read started on the device when that one ended,
        # at the latest when the host came back for it; any other step started when it was dispatched.
        elapsed = time.perf_counter() - (max(cur.at, self.back_at) if cur.early else cur.at)
        b, then, chain = cur.bucket, cur.then, cur.chain
        ctl.histogram[b] += 1  # (counted here, once per step read)
        if not timed:
            pass
        elif then == DRAFT:  # (flushes are not priced; the latency model prices bucket 1 by the
            # drafting root step: `LatencyModel.variant`)
            self.latency.observe(b or AR_DRAFT, context, elapsed)
        elif then == HOLD:
            self.latency.observe(held(b) if b else AR, context, elapsed)
        if gate is not None:
            gate.chained += chain
            if b and not chain:  # rho is the drafter's calibration (the rows' means, at any batch size)
                gate.observe_verify(b, float(self.curve[active, self.buckets.index(b)].mean()),
                                    float(counts[active].mean() - 1))
            elif chain:  # (the chain's hit rates are learnt on device; its curve's bias here)
                gate.observe_chain(b, cur.predicted, float(counts[active].mean() - 1))
            if not recorded:
                gate.record(then, int(counts[active].max()))
        # The next step is judged with this one's tokens counted (the read's curves are for then).
        self.remaining = None if remaining is None else np.maximum(remaining - counts, 0)
        last = last_rows(active, self.remaining, self.block_size)
        if gate is not None and then == DRAFT:
            gate.observe_tree(batch_curve(new_curve, last))
        self.holding = then != DRAFT
        self.curve = new_curve
        holds = self.holding and active.any()
        self.hint = batch_curve(new_curve, last) if holds else None
        self.hint_mean = new_curve[active].mean(axis=0) if holds else None
        # After the read: the next step, chosen now on what it showed, goes out before the host emits.
        if self.queued is None and tree_ahead and active.any() and not self._stopped(toks, counts, active):
            state, self.queued = self._dispatch_next(int((lengths + counts)[active].max()), state, active,
                                                     active_dev, next_key())
        return state, toks, counts
