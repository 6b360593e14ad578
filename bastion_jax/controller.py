"""Budget policies: which bucket (tree size) to verify next.

ar: no drafting; dflash: the drafter's top-1 chain; fixed:N: always bucket N; bastion: the bucket
maximising estimated tokens per second, (A(b) + 1) / T_hat(b, c), where A(b) is the tree's expected
accepted draft tokens (the surrogate) and T_hat the calibrated latency model, plus plain AR steps
when drafting does not pay (`draft_gate`); bastion-paper: the official implementation's per-node
stopping rule with sizes in steps of 32 (`paper_rule`), always drafting, for comparison.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np

from bastion_jax.latency import LatencyModel
from bastion_jax.paper_rule import S_MIN, interpolated, paper_buckets, paper_tree_size

DEFAULT_BUCKETS = (1, 4, 8, 16, 32, 64)
# On CPU a verify of 32 or 64 nodes costs several AR steps and bastion chose one in 13 of ~35,000
# steps of the committed suite runs, while every draft still built a tree of the largest bucket's
# nodes: capped at 16 a draft costs ~1.3 ms (13-15%) less and bastion ran 1.28-1.29x AR against
# 1.25-1.27x, with two tree steps fewer to compile and calibrate
# (benchmarks/results/cpu-smollm2-buckets16-ab-2026-12-06.md).
CPU_BUCKETS = (1, 4, 8, 16)


def default_buckets() -> tuple[int, ...]:
    """The tree sizes compiled when none are given: `CPU_BUCKETS` on CPU, `DEFAULT_BUCKETS` elsewhere.
    The tree a step drafts holds the largest bucket's nodes, so the largest bucket prices every draft."""
    import jax

    return CPU_BUCKETS if jax.default_backend() == "cpu" else DEFAULT_BUCKETS


class PolicyError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Policy:
    kind: str  # "ar" | "dflash" | "fixed" | "bastion" | "bastion-paper"
    size: int = 0  # the bucket of fixed:N

    @classmethod
    def parse(cls, text: str) -> "Policy":
        if text in ("ar", "dflash", "bastion", "bastion-paper"):
            return cls(text)
        if text.startswith("fixed:"):
            try:
                n = int(text.split(":", 1)[1])
            except ValueError:
                raise PolicyError(f"bad policy {text!r}: expected fixed:N with an integer N") from None
            if n < 1:
                raise PolicyError(f"bad policy {text!r}: N must be >= 1")
            return cls("fixed", n)
        raise PolicyError(f"unknown mode {text!r} (choose ar, dflash, fixed:N, bastion or bastion-paper)")

    @property
    def uses_tree(self) -> bool:
        return self.kind in ("fixed", "bastion", "bastion-paper")

    def __str__(self) -> str:
        return f"fixed:{self.size}" if self.kind == "fixed" else self.kind


def parse_buckets(text: str) -> tuple[int, ...]:
    try:
        buckets = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise PolicyError(f"bad --buckets {text!r}: expected comma-separated integers like 1,8,16,32") from None
    if not buckets or buckets[0] < 1:
        raise PolicyError(f"bad --buckets {text!r}: sizes must be >= 1")
    return buckets


def check_buckets(policies: Sequence[Policy], buckets: Sequence[int], flag: str = "--modes") -> None:
    """Refuse (PolicyError naming what to add to --buckets) the policies these compiled tree sizes
    cannot run: fixed:N with no bucket N, bastion-paper with no bucket of at least S_MIN nodes. The CLIs
    call it before loading anything, so a bad mode costs no minutes of loading and calibration.
    `flag`: the option that named the policies, for the message."""
    now = f"now {','.join(map(str, buckets))}"
    missing = sorted({q.size for q in policies if q.kind == "fixed"} - set(buckets))
    if missing:
        raise PolicyError(f"{flag} {','.join(f'fixed:{n}' for n in missing)} needs bucket(s) "
                          f"{','.join(map(str, missing))}: add them to --buckets ({now}; bastion's trees then "
                          "hold the largest)")
    if any(q.kind == "bastion-paper" for q in policies):
        try:
            paper_buckets(max(buckets))
        except ValueError as e:
            raise PolicyError(f"{e}: add one to --buckets ({now})") from None


def last_rows(active: np.ndarray, remaining: np.ndarray | None, block_size: int) -> np.ndarray:
    """[batch] bool: the active rows that may be the batch's last row after the next step, i.e. fewer
    than `block_size` tokens ahead of the row with most tokens still to emit (`remaining` [batch]: a
    step commits at most a block per row, so a row further ahead cannot be last). A batch ends with its
    last row, so bastion judges a step by these rows (`batch_curve`). Every active row when
    `remaining` is None or `block_size` is 0."""
    if remaining is None or not block_size or not active.any():
        return active
    r = np.where(active, remaining, np.iinfo(np.int64).min)
    return active & (r > r.max() - block_size)


def batch_curve(curve: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """[n_buckets]: the accepted drafts a step of each bucket is worth to a batch, from the rows'
    surrogate curves `curve` [batch, n_buckets]: the least among `rows` (`last_rows`), since the batch
    waits for whichever of them ends last; a mean let a batch draft for its predictable rows while its
    hard ones set the number of steps. One row: its own curve."""
    return (curve[rows] if rows.any() else curve).min(axis=0)


class Controller:
    """Chooses a bucket each step and counts how often each one was chosen."""

    def __init__(self, policy: Policy, buckets: tuple[int, ...], latency: LatencyModel | None = None):
        if policy.kind == "fixed" and policy.size not in buckets:
            raise PolicyError(f"unknown bucket {policy.size} for fixed:{policy.size} (compiled buckets: "
                              f"{', '.join(map(str, buckets))})")
        if policy.kind in ("bastion", "bastion-paper") and latency is None:
            raise PolicyError(f"the {policy} policy needs a latency model")
        if policy.kind == "bastion-paper":
            try:
                self.paper_buckets = paper_buckets(max(buckets))
            except ValueError as e:
                raise PolicyError(f"{e}; add one (--buckets, or Engine(buckets=...))") from None
        self.policy = policy
        self.buckets = buckets
        self.latency = latency
        self.histogram: collections.Counter[int] = collections.Counter()

    def choose(self, curve: np.ndarray, context: int, active: np.ndarray, path_probs: np.ndarray | None = None,
               record: bool = True) -> int:
        """curve: [batch, n_buckets] surrogate A(b) per row; context: longest committed length; active:
        the rows that count (bastion: the rows that may end the batch, `last_rows`); path_probs:
        [batch, n_nodes] per-node path probabilities (bastion-paper only). bastion maximises
        (`batch_curve` + 1) / T(b): the tokens per second of the row the batch waits for."""
        if self.policy.kind == "fixed":
            b = self.policy.size
        elif self.policy.kind == "bastion-paper":
            b = self.paper_size(path_probs[active].mean(axis=0) if active.any() else path_probs[0], context)
        else:
            expected = batch_curve(curve, active) + 1.0
            cost = np.array([self.latency.predict(b, context) for b in self.buckets])
            b = self.buckets[int(np.argmax(expected / cost))]
        if record:
            self.histogram[b] += 1
        return b

    def paper_size(self, path_probs: np.ndarray, context: int) -> int:
        """The official rule's size for one tree, on the compiled buckets' calibrated verify times
        (a step's time minus the price of its draft, which is the rule's T_draft)."""
        draft = max(self.latency.step_time(1, context, True) - self.latency.step_time(1, context, False), 0.0)
        verify = interpolated(self.buckets, [self.latency.predict(b, context) - draft for b in self.buckets])
        n = paper_tree_size(path_probs, verify, draft, s_max=max(self.buckets))
        return max((b for b in self.paper_buckets if b <= max(n, S_MIN)), default=self.paper_buckets[0])
