"""Bastion's batch rule replayed on single-row acceptance tables: which rows should judge a batch's step.

    python -m benchmarks.gate_headroom --max-prompts 24 --buckets 1,4,8,16 --save-tables runs/t0.npz
    python -m benchmarks.batch_replay runs/t0.npz --batch 4 --prices 42.4,59.1,72.8,95.1,144.2

A batch's rows share every step (one bucket for all, or a root step) and a request ends with its last
row. Each saved table (`gate_headroom --save-tables`: per answer position, what each bucket's tree
would accept and its surrogate curve) is one row; rows of a batch are grouped from the tables, per
prompt set (`same`), one row from each set in turn (`mixed`), or half MT-Bench and half gsm8k
(`pair`, the case that once made the rows' mean draft for the predictable half). The draft gate and
the controller then replay as `TreeLoop` runs them (lookup off), with the batch judged by one of:

  least    the engine's rule (`controller.batch_curve`): the least of the curves of the rows that
           may be last after the step (`controller.last_rows`)
  mean     those rows' mean curve
  judged   of those rows, the ones expected to end within `FINISH_SLACK` of the latest, a row's
           end being its remaining tokens over its pace, 1 + the mean of an EMA (rate `PACE_RATE`)
           of its trees' curves (`judged_rows`), by their mean curve

plus fixed:N. Step prices are constants in ms at the batch size (`--prices AR,AR+draft,tree...`, one
per bucket above 1, e.g. from `Engine.calibrate(..., batch=B)`); rows end at their answer's end, and
the rows' remaining tokens are `--max-new-tokens` minus what they emitted, as the engine knows them.
Reported: predicted tokens/s over AR per group kind (geometric means over sets). Writes
benchmarks/results/<name>.json and .md.

What it found (2026-12-07, `benchmarks/results/cpu-smollm2-batch-replay-2026-12-07.md`): with the
drafter's trees alone, `judged` beat `least` by 6% on batches of 4 like prompts and matched it on
mixed ones, but end to end, where the context lookup's and the datastore's chains join the trees,
batches of 4 chat prompts then drafted and fell to 0.73-0.82x AR where `least` held (0.95x): the
replay does not see the chains, so the engine keeps `least`.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

from benchmarks.gate_headroom import load_tables
from benchmarks.report import commit, write_results

RESULTS = Path(__file__).resolve().parent / "results"
RULES = ("least", "mean", "judged")
FINISH_SLACK = 0.2
PACE_RATE = 0.2


class ConstPrices:
    """Step seconds that do not depend on the context: the latency model's and `gate_headroom.Prices`'
    interfaces over `ar`, `ar_draft` and `tree` {bucket: seconds} (bucket 1: the drafting root step)."""

    def __init__(self, ar: float, ar_draft: float, tree: dict[int, float]):
        self.ar, self.ar_draft, self.trees = ar, ar_draft, tree
        self.buckets = (1,) + tuple(sorted(tree))
        self.latency = self

    def step_time(self, b: int, c: int, draft: bool) -> float:
        if b <= 1:  # a root step (bucket 1 verifies the root alone: the drafting root step)
            return self.ar_draft if (draft or b == 1) else self.ar
        return self.trees[b]

    def predict(self, b: int, c: int) -> float:
        return self.step_time(b, c, True)

    def context(self, t: int) -> int:
        return 0

    def root(self, draft: bool, t: int) -> float:
        return self.step_time(0, 0, draft)

    def tree(self, i: int, t: int) -> float:
        return self.step_time(self.buckets[i], 0, True)


def smoothed(pace: np.ndarray, curve: np.ndarray, rows: np.ndarray, rate: float = PACE_RATE) -> np.ndarray:
    """[batch, n_buckets]: `rows`' paces moved toward the curves of the trees they just drafted."""
    return np.where(rows[:, None], (1.0 - rate) * pace + rate * curve, pace)


def judged_rows(rows: np.ndarray, remaining: np.ndarray, pace: np.ndarray, slack: float = FINISH_SLACK) -> np.ndarray:
    """[batch] bool: of `rows`, those expected to end within `slack` of the latest (remaining tokens
    over 1 + the mean of the row's pace)."""
    end = np.where(rows, remaining / (1.0 + pace.mean(axis=1)), -np.inf)
    return rows & (end >= (1.0 - slack) * end.max())


def rule_curve(rule: str, curves: np.ndarray, last: np.ndarray, remaining: np.ndarray, pace: np.ndarray):
    """[n_buckets]: what a step of each bucket is worth to the batch under `rule` (`last`: the rows
    that may be last after the step)."""
    from bastion_jax.controller import batch_curve

    rows = last if last.any() else np.ones(len(curves), bool)
    if rule == "least":
        return batch_curve(curves, rows)
    if rule == "mean":
        return curves[rows].mean(axis=0)
    return curves[judged_rows(rows, remaining, pace)].mean(axis=0)


def advance(tables, t: np.ndarray, i: int) -> np.ndarray:
    """[batch] tokens each row commits in a step of bucket index `i` from positions `t` (its accepted
    drafts + 1, up to its answer's end; 0 for a row that has ended)."""
    n = np.array([len(a) for a, _ in tables])
    step = [int(a[min(p, len(a) - 1), i]) + 1 for (a, _), p in zip(tables, t)]
    return np.where(t < n, np.minimum(step, n - t), 0)


def replay_batch(tables: list[tuple[np.ndarray, np.ndarray]], buckets: tuple[int, ...], prices: ConstPrices,
                 rule: str, max_new_tokens: int, block_size: int = 16) -> float:
    """Seconds of bastion over one batch of rows (`tables`: each row's (accepted [T, n_buckets],
    surrogate [T, n_buckets])), its steps as `TreeLoop` chooses them with the batch judged by `rule`."""
    from bastion_jax.controller import Controller, Policy, last_rows
    from bastion_jax.draft_gate import DraftGate
    from bastion_jax.tree_decoding import DRAFT, HOLD, pending_slots

    sur = [s for _, s in tables]
    n = np.array([len(a) for a, _ in tables])
    gate = DraftGate(buckets, prices.step_time, pending_slots(block_size), block_size)
    ctl, one = Controller(Policy("bastion"), buckets, prices), np.ones(1, bool)
    t = np.zeros(len(tables), int)

    def curves() -> np.ndarray:
        return np.stack([s[min(p, len(s) - 1)] for s, p in zip(sur, t)])

    def judged_curve(active: np.ndarray) -> np.ndarray:
        left = max_new_tokens - t
        return rule_curve(rule, cur, last_rows(active, left, block_size), left, pace)

    def drafted() -> None:  # a step drafted fresh trees at the new positions: pace and gate learn them
        nonlocal cur, pace
        if (t < n).any():
            cur = curves()
            pace = smoothed(pace, cur, t < n)
            gate.observe_tree(judged_curve(t < n))

    cur = curves()
    pace = cur.astype(np.float64)
    gate.observe_tree(judged_curve(t < n))
    secs, holding = 0.0, False
    while (t < n).any():
        active = t < n
        if not holding:
            a = judged_curve(active)  # the batch's curve, chosen on as the controller chooses on one row's
            b = ctl.choose(a[None] * gate.rho, 0, one, record=False) if gate.use_tree(0, a) else 1
            if b != 1:
                i = buckets.index(b)
                secs += prices.step_time(b, 0, True)
                adv = advance(tables, t, i)
                gate.observe_verify(b, float(cur[active, i].mean()), float(adv[active].mean() - 1))
                gate.record(DRAFT, int(adv.max()))
                t = t + adv
                drafted()
                continue
        then = gate.root_then(0, None)
        secs += prices.step_time(0, 0, then != HOLD)
        gate.record(then, 1)
        t = t + active
        holding = then != DRAFT
        if not holding:
            drafted()
    return secs


def replay_fixed(tables, buckets: tuple[int, ...], prices: ConstPrices, b: int) -> float:
    """Seconds of fixed:b over one batch."""
    i, secs = buckets.index(b), 0.0
    t = np.zeros(len(tables), int)
    n = np.array([len(a) for a, _ in tables])
    while (t < n).any():
        secs += prices.step_time(b, 0, True)
        t = t + advance(tables, t, i)
    return secs


def groups(tables: dict, batch: int) -> dict[str, dict[str, list]]:
    """{kind: {set: [batch of rows, ...]}} for kinds same / mixed / pair (those the tables allow)."""
    per: dict[str, list] = {}
    for key in sorted(tables, key=lambda k: (k.split("/")[0], int(k.split("/")[1]))):
        acc, sur, _ = tables[key]
        per.setdefault(key.split("/")[0], []).append((acc, sur))
    out: dict[str, dict[str, list]] = {"same": {s: [r[i:i + batch] for i in range(0, len(r) - batch + 1, batch)]
                                                for s, r in per.items()}}
    m = min(len(r) for r in per.values())
    flat = [per[s][j] for j in range(m) for s in sorted(per)]
    out["mixed"] = {"all sets": [flat[i:i + batch] for i in range(0, len(flat) - batch + 1, batch)]}
    chat = [s for s in per if s.startswith("mt_bench")]
    maths = [s for s in per if s.startswith("gsm8k")]
    if chat and maths and batch % 2 == 0:
        a, b, h = per[chat[0]], per[maths[0]], batch // 2
        out["pair"] = {"chat + gsm8k": [a[i:i + h] + b[i:i + h] for i in range(0, min(len(a), len(b)) - h + 1, h)]}
    return {k: {s: g for s, g in v.items() if g} for k, v in out.items() if any(v.values())}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.batch_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tables", help="a .npz written by `gate_headroom --save-tables`")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prices", required=True,
                   help="step prices in ms at that batch size: AR,AR+draft,then one per bucket above 1")
    p.add_argument("--max-new-tokens", type=int, default=96, help="the tables' answer budget (default 96)")
    p.add_argument("--fixed", default="4,8", help="fixed:N sizes to replay beside the rules")
    p.add_argument("--name", help="results file name (default: none written)")
    p.add_argument("--out-dir", default=str(RESULTS))
    return p


def main(argv: list[str] | None = None) -> int:
    from bastion_jax.cli import fail

    args = build_parser().parse_args(argv)
    try:
        if args.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {args.batch}")
        try:
            buckets, tables = load_tables(args.tables)
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"cannot read tables {args.tables} (a `gate_headroom --save-tables` .npz): {e}") from None
        trees = [b for b in buckets if b > 1]
        try:
            ms = [float(x) for x in args.prices.split(",")]
        except ValueError:
            raise ValueError(f"--prices {args.prices!r}: expected comma-separated milliseconds") from None
        if len(ms) != 2 + len(trees):
            raise ValueError(f"--prices needs {2 + len(trees)} values (AR, AR+draft, buckets {trees}), got {len(ms)}")
    except ValueError as e:
        return fail(e)
    prices = ConstPrices(ms[0] / 1e3, ms[1] / 1e3, {b: v / 1e3 for b, v in zip(trees, ms[2:])})
    fixed = [int(x) for x in args.fixed.split(",") if x.strip() and int(x) in trees]
    policies = list(RULES) + [f"fixed:{b}" for b in fixed]
    report: dict[str, dict[str, float]] = {}
    for kind, sets in groups(tables, args.batch).items():
        speed = {p: [] for p in policies}
        for batches in sets.values():
            for p in policies:
                ratios = []
                for rows in batches:
                    ar = max(len(a) for a, _ in rows) * prices.ar
                    secs = (replay_fixed(rows, buckets, prices, int(p[6:])) if p.startswith("fixed:")
                            else replay_batch(rows, buckets, prices, p, args.max_new_tokens))
                    ratios.append(ar / secs)
                speed[p].append(float(np.exp(np.mean(np.log(ratios)))))
        report[kind] = {p: float(np.exp(np.mean(np.log(v)))) for p, v in speed.items()}
        report[kind]["batches"] = sum(len(b) for b in sets.values())
    lines = [f"Batch {args.batch}, prices {args.prices} ms, tables {args.tables}: predicted speed over AR "
             "(geometric means)", "", "| batches | n | " + " | ".join(policies) + " |", "|---" * (len(policies) + 2) + "|"]
    lines += [f"| {k} | {r['batches']} | " + " | ".join(f"{r[p]:.3f}" for p in policies) + " |" for k, r in report.items()]
    print("\n".join(lines))
    if args.name:
        meta = {"date": datetime.date.today().isoformat(), "commit": commit(), "tables": args.tables,
                "batch": args.batch, "prices_ms": ms, "buckets": list(buckets), "max_new_tokens": args.max_new_tokens}
        write_results(args.out_dir, args.name, {"meta": meta, "kinds": report}, "\n".join(lines), quiet=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
