"""What a request reports (`Stats`, `Result`) and the host's per-row bookkeeping (`Rows`)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass
class Stats:
    mode: str = "ar"
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # decoding steps after prefill
    committed: int = 0  # tokens committed by those steps, summed over rows (accepted + 1 each)
    row_steps: int = 0  # (row, step) pairs in which the row was active
    compile_s: float = 0.0  # warm-up: compiling new executables and their first (untimed) runs
    ttft_s: float = 0.0
    decode_s: float = 0.0
    compilations: int = 0  # by the engine during this request (warm-up)
    compilations_after_warmup: int = 0  # any XLA compilation in the timed request, prefill on (must stay 0)
    buckets: dict[int, int] = dataclasses.field(default_factory=dict)  # bucket -> times chosen
    chain_steps: int = 0  # bastion steps (counted in `buckets` too) that verified a held lookup chain, no draft
    ended: dict[str, int] = dataclasses.field(default_factory=dict)  # why rows ended -> rows ("stop token", ...)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of the engine's own wall time after compilation (prefill included;
        the time the caller spends between yielded steps, e.g. detokenising and printing, excluded)."""
        total = self.ttft_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens committed per row per step (accepted + 1); 1.0 for AR."""
        return self.committed / self.row_steps if self.row_steps else 0.0

    def summary(self) -> str:
        hist = ""
        if self.buckets:
            hist = " | buckets " + " ".join(f"{b or 'ar'}:{n}" for b, n in sorted(self.buckets.items()))
            if self.chain_steps:
                hist += f" ({self.chain_steps} verified a lookup chain without drafting)"
        return (f"new tokens {self.new_tokens} | {self.tokens_per_s:.1f} tok/s | tau {self.tau:.2f} | "
                f"TTFT {self.ttft_s * 1e3:.0f} ms | steps {self.steps}{hist} | "
                f"warm-up {self.compile_s:.1f}s ({self.compilations} compiled, "
                f"{self.compilations_after_warmup} after) | ended: {self.ended_summary()}")

    def ended_summary(self) -> str:
        """Why generation ended: "stop token" / "max new tokens" for one row, counts for a batch."""
        if sum(self.ended.values()) == 1:
            return next(iter(self.ended))
        return ", ".join(f"{n} {why}" for why, n in sorted(self.ended.items())) or "-"


@dataclasses.dataclass
class Result:
    tokens: list[list[int]]  # new tokens per prompt (stop token included if one was produced)
    stats: Stats


STOP_TOKEN, MAX_NEW_TOKENS = "stop token", "max new tokens"  # the only two ways a row ends


class Rows:
    """Host-side per-row bookkeeping: budget, stop ids, what each row has emitted and why it ended."""

    def __init__(self, batch: int, budget: int, stop_ids: frozenset[int]):
        self.done = np.zeros(batch, bool)
        self.produced = np.zeros(batch, np.int64)
        self.budget = budget
        self.stop_ids = stop_ids
        self.ended: list[str | None] = [None] * batch

    def take(self, i: int, tokens: Sequence[int]) -> list[int]:
        """Keep what row i may still emit: up to its budget, through its first stop id."""
        if self.done[i]:
            return []
        out = []
        for t in tokens:
            out.append(int(t))
            self.produced[i] += 1
            if int(t) in self.stop_ids or self.produced[i] >= self.budget:
                self.done[i] = True
                self.ended[i] = STOP_TOKEN if int(t) in self.stop_ids else MAX_NEW_TOKENS
                break
        return out
