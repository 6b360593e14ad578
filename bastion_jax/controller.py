"""Budget policies: which bucket (tree size) to verify next.

ar: no drafting; dflash: the drafter's top-1 chain; fixed:N: always bucket N; bastion: the bucket
maximising estimated tokens per second, (A(b) + 1) / T_hat(b, c), where A(b) is the tree's expected
accepted draft tokens (the surrogate) and T_hat the calibrated latency model.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from bastion_jax.latency import LatencyModel

DEFAULT_BUCKETS = (1, 4, 8, 16, 32, 64)


class PolicyError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Policy:
    kind: str  # "ar" | "dflash" | "fixed" | "bastion"
    size: int = 0  # the bucket of fixed:N

    @classmethod
    def parse(cls, text: str) -> "Policy":
        if text in ("ar", "dflash", "bastion"):
            return cls(text)
        if text.startswith("fixed:"):
            try:
                n = int(text.split(":", 1)[1])
            except ValueError:
                raise PolicyError(f"bad policy {text!r}: expected fixed:N with an integer N") from None
            if n < 1:
                raise PolicyError(f"bad policy {text!r}: N must be >= 1")
            return cls("fixed", n)
        raise PolicyError(f"unknown mode {text!r} (choose ar, dflash, fixed:N or bastion)")

    @property
    def uses_tree(self) -> bool:
        return self.kind in ("fixed", "bastion")

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


class Controller:
    """Chooses a bucket each step and counts how often each one was chosen."""

    def __init__(self, policy: Policy, buckets: tuple[int, ...], latency: LatencyModel | None = None):
        if policy.kind == "fixed" and policy.size not in buckets:
            raise PolicyError(f"unknown bucket {policy.size} for fixed:{policy.size} (compiled buckets: "
                              f"{', '.join(map(str, buckets))})")
        if policy.kind == "bastion" and latency is None:
            raise PolicyError("the bastion policy needs a latency model")
        self.policy = policy
        self.buckets = buckets
        self.latency = latency
        self.histogram: collections.Counter[int] = collections.Counter()

    def choose(self, curve: np.ndarray, context: int, active: np.ndarray) -> int:
        """curve: [batch, n_buckets] surrogate A(b) per row; context: longest committed length."""
        if self.policy.kind == "fixed":
            b = self.policy.size
        else:
            rows = curve[active] if active.any() else curve
            expected = rows.sum(axis=0) + rows.shape[0]  # committed tokens per step over active rows
            cost = np.array([self.latency.predict(b, context) for b in self.buckets])
            b = self.buckets[int(np.argmax(expected / cost))]
        self.histogram[b] += 1
        return b
