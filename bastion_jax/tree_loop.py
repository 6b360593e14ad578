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

Lookahead. A root step that does not draft commits exactly one token per active row and leaves no
tree to choose from, so the next step is known before its result is read: another root step, whose
`then` the gate decides on the context one token further. `TreeLoop` dispatches that step before
reading the current one, so the device works while the host reads, emits and yields (as the AR
loop does). A row that stops on the read step is computed once more and its token dropped; nothing
is dispatched past every row's token budget. Under fixed:N the next step is always the same tree
step (the bucket does not depend on what a step shows), so it is dispatched ahead too while every
active row has room for a full step more (`tree_ahead`); bastion's tree steps cannot be: the next
bucket is chosen on the fresh tree's surrogate curve, which only the read brings. Nor does a root
step go ahead when the chain read last would be worth verifying: the next step is then chosen on
the chain this one finds. (Choosing on the device instead, with `lax.switch` between a root step and
chain steps, was tried: XLA copies every state buffer into and out of a conditional, the KV cache
included, which doubled a root step's time on CPU.)
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from bastion_jax.controller import Controller
from bastion_jax.draft_gate import DraftGate
from bastion_jax.latency import AR, AR_DRAFT, LatencyModel
from bastion_jax.tree_decoding import DRAFT, HOLD


class Dispatched(NamedTuple):
    """A step on its way: what the host needs to read it and learn from it."""

    bucket: int  # the bucket verified (0: a root step)
    then: int
    out: Any
    curve: Any
    at: float  # when it was dispatched
    chain: bool = False  # a tree step verifying the held lookup chain


class TreeLoop:
    """Runs the steps of one request under a tree policy (fixed:N, bastion, bastion-paper).

    steps: bucket -> compiled tree step; roots: then -> compiled root step (bastion only, with `gate`);
    curve: the prefill's surrogate curves [batch, n_buckets] (what the first tree offers); chains:
    bucket -> tree step that holds after it (bastion with lookup: verify a held chain, no draft).
    """

    def __init__(self, kind: str, controller: Controller, gate: DraftGate | None, steps: dict, roots: dict | None,
                 latency: LatencyModel, buckets: tuple[int, ...], target_params, drafter_params, curve,
                 chains: dict | None = None):
        self.kind, self.controller, self.gate = kind, controller, gate
        self.steps, self.roots, self.latency, self.buckets = steps, roots, latency, buckets
        self.chains = chains or {}
        self.params = (target_params, drafter_params)
        self.curve = np.asarray(curve)  # [batch, n_buckets]
        if gate is not None:
            gate.observe_tree(self.curve.mean(axis=0))
        self.holding = False  # the last step did not draft: no tree in hand, the next step is a root step
        self.hint: np.ndarray | None = None  # the lookup chain's curve after the last step that did not draft
        self.queued: Dispatched | None = None  # a step dispatched ahead
        self.back_at = 0.0  # when the host last came back to the loop (its reads are timed from there)

    def _dispatch_root(self, then: int, state, active_dev, key) -> tuple[Any, Dispatched]:
        ts = time.perf_counter()
        state, out, curve = self.roots[then](*self.params, state, active_dev, key)
        return state, Dispatched(0, then, out, curve, ts)

    def _dispatch_tree(self, b: int, state, active_dev, key, then: int = DRAFT, chain: bool = False
                       ) -> tuple[Any, Dispatched]:
        ts = time.perf_counter()
        state, out, curve = (self.steps if then == DRAFT else self.chains)[b](*self.params, state, active_dev, key)
        return state, Dispatched(b, then, out, curve, ts, chain)

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
        return self._dispatch_root(then, state, active_dev, key)

    def step(self, state, active: np.ndarray, active_dev, context: int, next_key: Callable[[], Any],
             look_ahead: bool, tree_ahead: bool = False) -> tuple[Any, np.ndarray, np.ndarray]:
        """One step for the rows in `active` at committed context `context` (longest active row).
        next_key() gives the sampler of the step it is called for. `look_ahead`: a further step may
        still be needed (not every row is at its budget). `tree_ahead`: every active row has room for
        a whole tree step after this one (fixed:N dispatches it ahead then). Returns (state, tokens
        [batch, n], counts [batch])."""
        gate, ctl = self.gate, self.controller
        self.back_at = time.perf_counter()
        recorded = False  # the gate recorded this step already (when it dispatched the next one)
        if self.queued is not None:
            cur, self.queued = self.queued, None
        elif self.holding:
            state, cur = self._dispatch_holding(context, state, active_dev, next_key(), ahead=False)
        else:
            a = self.curve
            if gate is not None and (not gate.use_tree(context, a[active].mean(axis=0))
                                     or ctl.choose(a * gate.rho, context, active, record=False) == 1):
                # A plain AR step on the root (the tree in hand is dropped: drafting does not pay, or
                # the best bucket is the root alone, which a root step verifies without drafting).
                state, cur = self._dispatch_root(gate.root_then(context, self.hint), state, active_dev, next_key())
            else:
                probs = np.exp(np.asarray(state.tree.log_probs)) if self.kind == "bastion-paper" else None
                b = ctl.choose(a * (gate.rho if gate else 1.0), context, active, probs, record=False)
                state, cur = self._dispatch_tree(b, state, active_dev, next_key())
        # Look ahead: a root step that does not draft commits exactly one token per row, and the next
        # step is a root step whatever this one shows, unless the chain read last may be worth verifying.
        if (look_ahead and cur.bucket == 0 and cur.then != DRAFT
                and not self._chain_bucket(context + 1, HOLD)):
            gate.record(cur.then, 1)
            recorded = True
            state, self.queued = self._dispatch_holding(context + 1, state, active_dev, next_key(), ahead=True)
        elif tree_ahead and self.kind == "fixed":
            state, self.queued = self._dispatch_tree(cur.bucket, state, active_dev, next_key())
        toks, counts, new_curve = jax.device_get((cur.out.tokens, cur.out.count, cur.curve))
        # A step dispatched ahead ran partly while the host was away: time it from the host's return.
        elapsed = time.perf_counter() - max(cur.at, self.back_at)
        b, then, chain = cur.bucket, cur.then, cur.chain
        ctl.histogram[b] += 1  # (counted here, once per step read)
        if then == DRAFT:  # tree steps that hold and flushes are not calibrated variants
            self.latency.observe(b or AR_DRAFT, context, elapsed)
        elif then == HOLD and b == 0:
            self.latency.observe(AR, context, elapsed)
        if gate is not None:
            gate.chained += chain
            if b and not chain:  # rho is the drafter's calibration: a chain's outcome is learnt on device
                gate.observe_verify(b, float(self.curve[active, self.buckets.index(b)].mean()),
                                    float(counts[active].mean() - 1))
            if not recorded:
                gate.record(then, int(counts[active].max()))
            if then == DRAFT:
                gate.observe_tree(new_curve[active].mean(axis=0))
        self.holding = then != DRAFT
        self.curve = new_curve
        self.hint = new_curve[active].mean(axis=0) if self.holding and active.any() else None
        return state, toks, counts
