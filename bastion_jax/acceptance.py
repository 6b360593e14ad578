"""Acceptance report of a drafter (issue 13.4): tau per decoding mode and per prompt set, AR identity checked.

tau (mean committed tokens per step of a row: accepted drafts + 1) is what a drafter is worth,
independent of the machine; tokens/s is the benchmark harness's job (`python -m benchmarks.run`).
Prompts run in batches (greedy output is per-row identical to a single-prompt run, so batching
only speeds the report up); `bastion` then chooses one tree size per step for the whole batch.

Prompt files are JSONL(.gz) with the first user turn under `turns`, `question`, `problem`,
`prompt`, `text` or `instruction` (+ `input`); the evaluation sets have standard names that
resolve in ../shared/data beside the checkout.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from bastion_jax.stats import Stats

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
STANDARD_SETS = {  # name -> file in ../shared/data (evaluation sets: never trained on)
    "mt_bench": "mt_bench_questions.jsonl.gz",
    "gsm8k_test": "gsm8k_test.jsonl.gz",
    "math500": "math500_test.jsonl.gz",
    "humaneval": "humaneval.jsonl.gz",
    "mbpp": "mbpp.jsonl.gz",
    "spec_bench": "spec_bench_questions.jsonl.gz",
}


class PromptError(ValueError):
    """A prompts file that cannot be read or holds no prompt."""


def resolve_prompt_file(spec: str) -> Path:
    """A standard set's name (in ../shared/data beside the checkout) or a JSONL(.gz) path."""
    path = SHARED_DATA / STANDARD_SETS[spec] if spec in STANDARD_SETS else Path(spec)
    if not path.is_file():
        raise PromptError(f"prompts file not found: {path}" + (" (pass the file's path instead)"
                                                              if spec in STANDARD_SETS else ""))
    return path


def prompt_text(record: dict) -> str | None:
    """The first user turn of a record, whatever the data set calls it (None when it has none)."""
    if isinstance(record.get("turns"), list) and record["turns"]:
        return str(record["turns"][0])
    for key in ("question", "problem", "prompt", "text"):
        if isinstance(record.get(key), str):
            return record[key]
    if isinstance(record.get("instruction"), str):
        extra = record.get("input") or ""
        return record["instruction"] + ("\n\n" + extra if extra else "")
    return None


def read_prompts(path: str | Path, limit: int) -> list[str]:
    """Up to `limit` prompts of a JSONL(.gz) file, in file order."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    out: list[str] = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if len(out) >= limit:
                    break
                if line.strip():
                    text = prompt_text(json.loads(line))
                    if text:
                        out.append(text)
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PromptError(f"cannot read prompts from {path}: {e}") from None
    if not out:
        raise PromptError(f"no prompt in {path} (expected JSONL records with turns/question/problem/prompt/text)")
    return out


def set_name(path: str | Path) -> str:
    return Path(path).name.split(".")[0]


def decode(engine, prompts: list[list[int]], max_new_tokens: int, mode: str) -> tuple[list[list[int]], Stats,
                                                                                     list[int]]:
    """(new tokens per prompt, statistics, the token each row step ended on) of one batch: the last
    token a row committed in a step is the target's own, where that step's drafted run stopped (or
    the block, the budget or a stop token ended it)."""
    stats = Stats()
    out: list[list[int]] = [[] for _ in prompts]
    ended: list[int] = []
    for step in engine.stream(prompts, max_new_tokens=max_new_tokens, mode=mode, stats=stats):
        for row, toks in zip(out, step):
            if toks:
                row.extend(toks)
                ended.append(toks[-1])
    return out, stats, ended


def acceptance(engine, sets: dict[str, list[list[int]]], modes: Sequence[str], max_new_tokens: int,
               batch_size: int = 8, progress=None, rare: np.ndarray | None = None) -> dict[str, dict[str, dict]]:
    """{set: {mode: {tau, steps, committed, identical_to_ar, buckets[, ended_rare, rare_share]}}} for
    prompt token lists per set.

    AR runs first on every batch as the reference; every other mode's tokens must equal it (T=0).
    `rare` [vocab] bool marks the tokens a drafter rarely or never learnt to draft (outside its ranked
    top N: its training loss ignored them, and a tree drafting over that vocabulary cannot offer
    them); then each mode also counts `ended_rare`, its row steps that ended on such a token, and
    `rare_share` is their share of the AR text. `progress(set, mode, stats)` is called after each
    batch when given."""
    report: dict[str, dict[str, dict]] = {}
    for name, prompts in sets.items():
        rows = {m: {"steps": 0, "committed": 0, "identical_to_ar": True, "buckets": {}} for m in modes}
        text = text_rare = 0
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            reference = decode(engine, chunk, max_new_tokens, "ar")[0]
            if rare is not None:
                text += sum(len(t) for t in reference)
                text_rare += sum(int(rare[x]) for t in reference for x in t)
            for m in modes:
                tokens, stats, ended = decode(engine, chunk, max_new_tokens, m)
                r = rows[m]
                r["steps"] += stats.row_steps
                r["committed"] += stats.committed
                r["identical_to_ar"] &= tokens == reference
                for b, n in stats.buckets.items():
                    r["buckets"][str(b)] = r["buckets"].get(str(b), 0) + n
                if rare is not None:
                    r["ended_rare"] = r.get("ended_rare", 0) + sum(int(rare[x]) for x in ended)
                if progress:
                    progress(name, m, stats)
        for r in rows.values():
            r["tau"] = r["committed"] / r["steps"] if r["steps"] else 0.0
            if rare is not None:
                r["rare_share"] = text_rare / text if text else 0.0
        report[name] = rows
    return report


def markdown(report: dict[str, dict[str, dict]], modes: Sequence[str], rare_top: int | None = None) -> list[str]:
    """tau per set (rows) and mode (columns), pooled over each set's steps, with an 'all' row; with
    `rare_top` (the report counted `acceptance(rare=...)` for the top-N ranking), the share of row steps
    per mode that ended on a token outside it."""
    lines = ["| set | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for name, rows in report.items():
        lines.append(f"| {name} | " + " | ".join(f"{rows[m]['tau']:.2f}" for m in modes) + " |")
    pooled = []
    for m in modes:
        steps = sum(rows[m]["steps"] for rows in report.values())
        pooled.append(sum(rows[m]["committed"] for rows in report.values()) / steps if steps else 0.0)
    lines.append("| all | " + " | ".join(f"{t:.2f}" for t in pooled) + " |")
    same = all(rows[m]["identical_to_ar"] for rows in report.values() for m in modes)
    lines += ["", f"Every mode's text identical to AR: {'yes' if same else 'NO'}."]
    if rare_top is not None:
        ended = []
        for m in modes:
            steps = sum(rows[m]["steps"] for rows in report.values())
            ended.append(f"{m} {sum(rows[m]['ended_rare'] for rows in report.values()) / steps:.1%}" if steps else m)
        lines += ["", f"Row steps that ended on a token outside the drafter's top {rare_top} ranked tokens (what "
                  f"its training loss scored and a tree over that vocabulary drafts; the drafted run stopped there): "
                  f"{', '.join(ended)}; such tokens are "
                  + ", ".join(f"{n} {rows[modes[0]]['rare_share']:.1%}" for n, rows in report.items())
                  + " of the AR text."]
    return lines


def write_report(out: str | Path, report: dict[str, dict[str, dict]], table: list[str], meta: dict,
                 setting: str) -> list[Path]:
    """`out`.json (meta and every figure) and `out`.md (a title, the run's `setting` in words, and `table`,
    the report's `markdown` lines); returns the two paths. The markdown names the device, date and dtype
    from `meta`, as results must."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out.with_suffix(".json"), out.with_suffix(".md")
    json_path.write_text(json.dumps({"meta": meta, "tau": report}, indent=2))
    head = [f"# Acceptance: {Path(meta['drafter']).name}", "",
            f"{meta['device']}, {meta['date']}, {meta['dtype']}; {meta['max_new_tokens']} new tokens, T=0, {setting}; "
            "tau = mean committed tokens per row step (accepted drafts + 1).", ""]
    md_path.write_text("\n".join(head + table) + "\n")
    return [json_path, md_path]
