"""Draft or not: whether the step being dispatched should also draft the tree for the step after it.

Drafting for step t+1 is fused into the end of step t. A tree step always drafts; a root step (a
plain AR step on the target) holds, drafts or flushes, chosen before it runs from what the host
already knows: the surrogate curves of recent trees, how much of the surrogate was really
accepted, and the latency model (which prices a step with and without its draft). When a tree is
in hand but drafting no longer pays, the host takes a root step instead (that one draft is lost).

With a the expected accepted drafts, the steady-state rates are

    drafting:      R_d = max_b (rho * A_bar(b) + 1) / T(b, c, draft)
    not drafting:  R_0 = 1 / T(root, c, hold)         (a plain AR step on the target)

where A_bar is an EMA of the surrogate curves A(b) of recent trees and rho the drafter's
calibration: realised accepted drafts over the surrogate of the bucket that was verified, as a
ratio of two slow running means (a drafter may be over-confident: rho < 1 corrects it). A ratio of
the sums, not a mean of per-step ratios: accepted / surrogate is 0 for most small trees and large
for a few, so a mean of (clipped) ratios read a calibrated drafter as rho ~ 0.6-0.8, and the gate
then drafted too little and chose too small trees. Slow, because rho measures the drafter, not the
text (the tree's own curve carries the text's difficulty). The gate drafts next iff
R_d > (1 + margin) R_0, or drafting pays as an option (below).

Measured (`benchmarks/gate_headroom.py --save-tables`: SmolLM2 + drafter v11, CPU step prices,
policies replayed on the same acceptance tables): the surrogate's per-bucket mean is within ~10% of
the realised acceptance, while the old estimator (EMA of clipped ratios, rate 0.3) settled at
rho 0.58-0.80. The ratio of the means (prior weight 8, then EMAs at rate 0.05) with no margin (0.1
before) raised the replayed speed over AR from 1.10x to 1.12x on five development sets (EAGLE
alpaca / qa / sum, gsm8k and code_alpaca training prompts; geometric mean), and from 1.06x to 1.10x
on the evaluation sets (gsm8k 1.11 -> 1.23, mbpp 1.17 -> 1.25, mt_bench 0.99 -> 0.98). Each replayed
answer starts a fresh gate; the engine keeps rho's sums across requests.

Drafting also buys an option. A draft costs (T(root, draft) - T(root)) / T(root) of an AR step, and
its tree is then verified only if it pays, so what drafting is worth is the mean over trees of what
each would gain, not what the mean tree would: a text where one tree in eight promises 3 accepted
drafts and the rest none has a mean curve that does not pay, yet drafting pays there. In AR-step
units (time valued at the AR rate), a tree with curve a, verified at its best bucket, gains over a
root step that drafts

    g(a) = max(0, max_b [(rho a(b) + 1) - T(b, c, draft) / T(root)] - (1 - T(root, draft) / T(root)))

and the gate also drafts when the mean of g over the last `window` trees' curves exceeds the
draft's price (`option_pays`). Replayed on saved acceptance tables (drafter v14, CPU step prices,
lookup off, geometric means): evaluation sets 1.155x -> 1.167x AR (humaneval 1.087 -> 1.128, mbpp
1.326 -> 1.362, math500 1.066 -> 1.055), development sets (EAGLE alpaca / qa / sum) 1.020x -> 1.026x;
on the same tables priced by a skewed calibration (most likely taken on a busy machine) 1.047x ->
1.054x and 1.008x -> 1.006x (`benchmarks/results/cpu-smollm2-method-probes.md`, section 8).

A step in hand sharpens A_bar: a drafted tree's own curve, and after a step that did not draft the
context lookup's chain curve (`lookup.chain_curve`, computed on device without the drafter: a long
match means a copy is coming). Either enters as max(A_bar, curve) for that decision only.

Verifying the lookup chain without drafting. A step that did not draft leaves the root and the
lookup chain as its tree (`tree.chain_tree`), and the chain's curve c(b) comes back with it. A
tree step of bucket b may then verify that chain instead of a root step, at the price of a verify
without the draft (`chain_bucket`):

    chain:         R_c = max_b (rho_c(b) c(b) + 1) / T(b, c, then)      (b <= block size: the chain's nodes)

taken when R_c > (1 + chain_margin) R_0 (R_0 with the same `then`). The chain's probabilities are
this request's own hit rates (`lookup.probabilities`), not the drafter's, but its curve still has
a bias of its own, which rho_c(b) (realised over predicted accepted tokens of the chains verified at
b, kept like rho) takes out (`chain_rho`). T(b, c, then) of a step that holds is calibrated as its
own variant (`latency.held`).

While it does not draft it learns nothing new, so it probes: after `probe` consecutive AR steps it
drafts once; the tree that comes back refreshes A_bar, and it is verified when drafting pays by the
usual rule or when its own curve pays with rho taken as at least 1 (an optimistic reading, so that a
rho learnt where drafts did badly cannot hide that they now do well: a verify refreshes rho), else
dropped for a root step (only the draft's price is lost, not a whole tree step's). A probe that does
not pay doubles the interval (up to `max_probe`); one that pays resets it. (Verifying every probe's
tree, as before, cost ~1% on the replayed evaluation tables: 1.104x -> 1.114x AR, mt_bench 0.984 ->
0.995, humaneval 1.061 -> 1.095; on the development tables 1.1216 -> 1.1238.)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from bastion_jax.tree_decoding import DRAFT, FLUSH, HOLD


@dataclasses.dataclass
class DraftGate:
    """Host-side state of the draft-or-not rule (see the module docstring for the formula).

    `step_time(b, context, draft)` is the latency model's prediction; b = 0 is a root (AR) step.
    """

    buckets: tuple[int, ...]
    step_time: Callable[[int, int, bool], float]
    pending_slots: int  # W of the feature buffer: the gate flushes before it would overflow
    block_size: int
    # The most rows a held step adds to the feature buffer: 1 (a root step), or the largest chain
    # bucket when held lookup chains may be verified (`chain_bucket`); the gate flushes while one more
    # still fits.
    held_rows: int = 1
    rate: float = 0.3  # EMA rate of A_bar
    # Drafting must beat plain AR steps by this fraction. 0: with rho unbiased, a margin (0.1 before)
    # only cost speed in the replays (a dropped draft on a switch is cheap next to the steps it wins).
    margin: float = 0.0
    min_probe: int = 4
    max_probe: int = 64
    # rho's two sums are running means while fewer than 1 / rho_rate - prior_weight trees were
    # verified, then EMAs: the prior rho = 1 counts as `prior_weight` verified trees, so a drafter whose
    # surrogate is never realised is found out in a few verifies (about 10 at a surrogate of 7), and a
    # calibrated one is not talked down by its first few unlucky trees.
    rho_rate: float = 0.05
    prior_weight: float = 8.0
    accepted_ema: float = 1.0  # mean accepted drafts of verified trees (rho's numerator)
    surrogate_ema: float = 1.0  # mean of their surrogates A(bucket) (the denominator; 1 / 1: rho starts at 1)
    verified: int = 0  # trees observed by `observe_verify`
    a_bar: np.ndarray | None = None  # [n_buckets]
    probe: int = 4
    since_draft: int = 0
    pending: int = 0  # buffered feature rows (max over rows)
    drafted: int = 0  # how many steps drafted (statistics)
    held: int = 0
    probing: bool = False  # the last root step drafted as a probe: judge its tree on its own curve
    # A held chain is verified when that beats a root step by this fraction. Smaller than `margin`:
    # nothing is dropped either way, and the chain's probabilities are learnt on this very text.
    chain_margin: float = 0.05
    chained: int = 0  # how many steps verified a held chain (statistics)
    # Per chain bucket b: (realised accepted, predicted A(b), verified) of held chains verified at b:
    # the chain's own rho (`chain_rho`), learnt like the drafter's.
    chain_sums: dict[int, tuple[float, float, int]] = dataclasses.field(default_factory=dict)
    window: int = 16  # trees whose curves price the option of drafting (`option_pays`; 0: no option)
    recent: list[np.ndarray] = dataclasses.field(default_factory=list)  # their curves [n_buckets] each

    def memory(self) -> dict:
        """What carries over to the engine's next request (`restore`): rho's sums, A_bar and the recent
        curves, the probe interval and the chains' rho."""
        return {"calibration": (self.accepted_ema, self.surrogate_ema, self.verified), "a_bar": self.a_bar,
                "recent": list(self.recent), "probe": self.probe, "chains": dict(self.chain_sums)}

    def restore(self, memory: dict) -> None:
        """Take up what an earlier request's gate learnt (`memory`; missing keys keep this gate's values).
        The probe interval too: a request whose first tree or lookup chain pays drafts at once whatever
        the interval (`use_tree`, `root_then`), while text like the last request's is not probed from 4
        again."""
        self.accepted_ema, self.surrogate_ema, self.verified = memory.get(
            "calibration", (self.accepted_ema, self.surrogate_ema, self.verified))
        self.a_bar = memory.get("a_bar", self.a_bar)
        self.recent = self._latest(memory.get("recent", self.recent))
        self.probe = memory.get("probe", self.probe)
        self.chain_sums = dict(memory.get("chains", self.chain_sums))

    def observe_tree(self, curve: np.ndarray) -> None:
        """A fresh tree arrived: curve [n_buckets] = A(b) (of a batch: the least over the rows that may end
        it, `controller.batch_curve`)."""
        curve = np.asarray(curve, np.float64)
        self.a_bar = curve if self.a_bar is None else (1 - self.rate) * self.a_bar + self.rate * curve
        self.recent = self._latest([*self.recent, curve])

    def _latest(self, curves) -> list[np.ndarray]:
        """The last `window` of `curves` (none with window 0): what `option_pays` averages over."""
        return list(curves)[-self.window:] if self.window > 0 else []

    @property
    def rho(self) -> float:
        """Realised / predicted accepted drafts: EMA(accepted) / EMA(surrogate)."""
        return self.accepted_ema / self.surrogate_ema if self.surrogate_ema > 1e-9 else 1.0

    @rho.setter
    def rho(self, value: float) -> None:
        """Set the ratio, keeping the weight of the evidence (the denominator)."""
        self.accepted_ema = float(value) * self.surrogate_ema

    def observe_verify(self, bucket: int, surrogate: float, accepted: float) -> None:
        """A tree of `bucket` nodes with surrogate A(bucket) was verified and `accepted` drafts were
        kept (means over active rows): update rho's two sums."""
        self.accepted_ema, self.surrogate_ema, self.verified = self._ratio_update(
            (self.accepted_ema, self.surrogate_ema, self.verified), accepted, surrogate)

    def _ratio_update(self, sums, accepted: float, predicted: float) -> tuple[float, float, int]:
        """(accepted, predicted, n) sums of a ratio estimate after one more observation: running means
        while n + prior_weight < 1 / rho_rate, then EMAs (the prior ratio 1 weighs prior_weight)."""
        acc, pred, n = sums
        r = max(self.rho_rate, 1.0 / (n + self.prior_weight))
        return (1 - r) * acc + r * float(accepted), (1 - r) * pred + r * float(predicted), n + 1

    def chain_rho(self, bucket: int) -> float:
        """Realised / predicted accepted tokens of held lookup chains verified at `bucket` (1 before any):
        the chain's probabilities are learnt per request, but they carry a bias no request corrects. A
        step verifying a chain is chosen on its curve at the bucket that looks best (the winner of a
        max over noisy estimates), and the geometric tail first * cont^(d-1) of a long chain is
        too long (continuation hit rates fall with depth): on chat prompts (SmolLM2 + v12, CPU) 15-node
        chains promised 5.7 accepted tokens and gave 1.6, 3- and 7-node chains were within ~10%."""
        acc, pred, _ = self.chain_sums.get(bucket, (1.0, 1.0, 0))
        return acc / pred if pred > 1e-9 else 1.0

    def observe_chain(self, bucket: int, predicted: float, accepted: float) -> None:
        """A held chain was verified at `bucket`, predicted to yield `predicted` accepted tokens (its
        curve at that bucket), and `accepted` were (means over active rows)."""
        self.chain_sums[bucket] = self._ratio_update(self.chain_sums.get(bucket, (1.0, 1.0, 0)), accepted, predicted)

    def best(self, context: int, curve: np.ndarray | None = None) -> tuple[int, float]:
        """(bucket, tokens/s) of the best drafting step under the current estimates; `curve` [n_buckets]
        (this step's tree or lookup chain) counts where it beats A_bar."""
        if self.a_bar is None:
            return self.buckets[-1], float("inf")
        return self._best_rate(self.a_bar if curve is None else np.maximum(self.a_bar, curve), self.rho, context)

    def _best_rate(self, a: np.ndarray, rho: float, context: int) -> tuple[int, float]:
        """(bucket, tokens/s) maximising (rho A(b) + 1) / T(b, c, draft) over the buckets of curve `a`."""
        rates = [(rho * x + 1.0) / self.step_time(b, context, True) for b, x in zip(self.buckets, a)]
        i = int(np.argmax(rates))
        return self.buckets[i], float(rates[i])

    def _beats_ar(self, rate: float, context: int) -> bool:
        """rate > (1 + margin) R_0, R_0 the plain AR step's tokens/s at this context."""
        return rate > (1.0 + self.margin) / self.step_time(0, context, False)

    def pays(self, context: int, curve: np.ndarray | None = None) -> bool:
        """R_d > (1 + margin) R_0: drafting beats plain AR steps at this context, by the margin."""
        return self._beats_ar(self.best(context, curve)[1], context)

    def option_pays(self, context: int) -> bool:
        """Drafting pays as an option: the mean over the recent trees' curves of what each would gain,
        verified at its best bucket, over a root step that drafts (in AR steps, `g` of the module
        docstring) exceeds the draft's price (T(root, draft) - T(root)) / T(root). False before any tree."""
        if not self.recent:
            return False
        ar, ar_draft = self.step_time(0, context, False), self.step_time(0, context, True)
        cost = np.array([self.step_time(b, context, True) for b in self.buckets]) / ar  # [n_buckets]
        value = (self.rho * np.stack(self.recent) + 1.0 - cost).max(axis=1)  # [trees]: best verify, AR steps
        gain = np.maximum(value - (1.0 - ar_draft / ar), 0.0)
        return float(gain.mean()) > (ar_draft - ar) / ar

    def use_tree(self, context: int, curve: np.ndarray | None = None) -> bool:
        """With a drafted tree in hand (its curve [n_buckets]): verify it (a tree step, which drafts
        again) or not. A probe's tree is also verified when its own curve pays at rho >= 1: only a
        verify refreshes rho, and a rho learnt where drafts did badly would otherwise keep the gate
        from ever seeing that they now do well."""
        probing, self.probing = self.probing, False
        if self.pays(context, curve):
            return True
        if not probing or curve is None:
            return False
        return self._beats_ar(self._best_rate(curve, max(self.rho, 1.0), context)[1], context)

    def root_then(self, context: int, hint: np.ndarray | None = None) -> int:
        """`then` of a root step: DRAFT when drafting pays, by the mean curve (with `hint`, the lookup
        chain's curve after the last step read, if any) or as an option (`option_pays`), or a probe is
        due; FLUSH when the feature buffer could not take another held step; else HOLD. Call `record`
        once the step returned."""
        if self.pays(context, hint) or self.option_pays(context):
            self.probe = self.min_probe
            return DRAFT
        if self.since_draft + 1 >= self.probe:
            self.probe = min(2 * self.probe, self.max_probe)
            self.probing = True  # its tree is verified whatever the estimates say (`use_tree`)
            return DRAFT  # probe: a fresh tree tells whether the text became predictable
        if self.pending + 1 + self.held_rows > self.pending_slots:
            return FLUSH  # the next held step might not fit: catch the drafter up without drafting
        return HOLD

    def chain_bucket(self, context: int, hint: np.ndarray | None, then: int) -> int:
        """The bucket of a step that verifies the held lookup chain (its curve `hint` [n_buckets])
        before it does `then`, or 0 when a root step pays as well (or no chain step may run: FLUSH,
        or the step's committed rows would not fit in the feature buffer)."""
        if hint is None or then == FLUSH:
            return 0
        draft = then == DRAFT
        best, best_rate = 0, (1.0 + self.chain_margin) / self.step_time(0, context, draft)
        for b, a in zip(self.buckets, hint):
            if 1 < b <= self.block_size and self.pending + b <= self.pending_slots:
                rate = (self.chain_rho(b) * float(a) + 1.0) / self.step_time(b, context, draft)
                if rate > best_rate:
                    best, best_rate = b, rate
        return best

    def record(self, then: int, committed: int) -> None:
        """After a step (a tree step is a DRAFT): `committed` = most tokens any active row committed."""
        if then == HOLD:
            self.pending += committed
            self.since_draft += 1
            self.held += 1
        else:
            self.pending = 0
            self.since_draft = 0 if then == DRAFT else self.since_draft + 1
            self.drafted += then == DRAFT
