"""Tables, CSV and a plot for `benchmarks.run`: per data set and mode, tokens/s, tau, the ratio to AR
measured in the same run, and the best fixed budget in hindsight."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path


def write_results(out_dir, name: str, record: dict, markdown: str, quiet: bool = False) -> None:
    """`record` as <out_dir>/<name>.json and `markdown` as .md beside it (the benchmarks' results files);
    the table is also printed unless `quiet`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    if not quiet:
        print(markdown, end="" if markdown.endswith("\n") else "\n")
        print(f"wrote {out / name}.json and .md")


def commit() -> str:
    """The checkout's short commit, with "+dirty" when tracked files differ from it (a device run of
    an uncommitted fix must not pass for the commit before it)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent,
                              check=True).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no")
                                                     else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def per_set(rows: list[dict], modes: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """{set: {mode: {tokens_per_s, tau, ratio_to_ar}}} pooled over the set's prompts (tokens / seconds)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for src in dict.fromkeys(r["source"] for r in rows):
        out[src] = {}
        for m in modes:
            mine = [r for r in rows if r["source"] == src and r["mode"] == m]
            tokens, seconds = sum(r["new_tokens"] for r in mine), sum(r["seconds"] for r in mine)
            steps = sum(r["steps"] for r in mine)
            out[src][m] = {"tokens_per_s": tokens / seconds if seconds else 0.0,
                           "tau": sum(r["tau"] * r["steps"] for r in mine) / steps if steps else 0.0}
        ar = out[src]["ar"]["tokens_per_s"]
        for m in modes:
            out[src][m]["ratio_to_ar"] = out[src][m]["tokens_per_s"] / ar if ar else 0.0
    return out


def best_fixed(sets: dict, modes: list[str]) -> dict[str, str | None]:
    """The fastest fixed:N per set, chosen in hindsight."""
    fixed = [m for m in modes if m.startswith("fixed:")]
    return {src: (max(fixed, key=lambda m: by_mode[m]["tokens_per_s"]) if fixed else None)
            for src, by_mode in sets.items()}


def write_csv(path: Path, sets: dict, modes: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["set", "mode", "tokens_per_s", "tau", "ratio_to_ar"])
        for src, by_mode in sets.items():
            for m in modes:
                v = by_mode[m]
                w.writerow([src, m, f"{v['tokens_per_s']:.3f}", f"{v['tau']:.3f}", f"{v['ratio_to_ar']:.3f}"])


def markdown_table(sets: dict, modes: list[str]) -> list[str]:
    best = best_fixed(sets, modes)
    lines = ["tokens/s ratio to AR (tau) per set; best fixed in hindsight marked *:", "",
             "| set | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for src, by_mode in sets.items():
        cells = [f"{by_mode[m]['ratio_to_ar']:.2f} ({by_mode[m]['tau']:.2f})" + ("*" if m == best[src] else "")
                 for m in modes]
        lines.append(f"| {src} | " + " | ".join(cells) + " |")
    return lines


def plot(path: Path, sets: dict, modes: list[str], title: str) -> None:
    try:  # a device image may lack matplotlib: the JSON, CSV and markdown are the results, the plot a view
        import matplotlib
    except ImportError:
        print(f"no plot ({path.name}): matplotlib is not installed", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(sets)
    x = np.arange(len(names))
    width = 0.8 / max(1, len(modes))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2 + 1.6 * len(names)) * 1.6, 4.5))
    for i, m in enumerate(modes):
        axes[0].bar(x + i * width, [sets[s][m]["ratio_to_ar"] for s in names], width, label=m)
        axes[1].bar(x + i * width, [sets[s][m]["tau"] for s in names], width, label=m)
    axes[0].axhline(1.0, color="black", lw=0.8)
    for ax, label in zip(axes, ("tokens/s / AR (same run)", "tau (committed tokens per step)")):
        ax.set_xticks(x + width * (len(modes) - 1) / 2, names, rotation=20)
        ax.set_ylabel(label)
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
