"""What a profile run writes: a markdown table, a plot, the measurements and calibration JSON."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path

import numpy as np

from bastion_jax.profiler import Profile


# -- reports ----------------------------------------------------------------------------------------

def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}" if math.isfinite(s) else "-"


def markdown(title: str, meta: dict, prof: Profile) -> str:
    peaks = meta["peaks"]
    lines = [f"# {title}", "",
             f"{meta['device']}, {meta['date']}, {meta['dtype']}, target {meta['model']}, cache {prof.cache_len} "
             f"slots, batch 1, median of {meta['reps']} (after {meta['warmup']} warm-up)", "",
             f"Peaks ({peaks['source']}): {peaks['bandwidth'] / 1e9:.1f} GB/s copy bandwidth, "
             f"{peaks['flops'] / 1e12:.3f} TFLOP/s matmul; datasheet {meta['datasheet']['bandwidth'] / 1e9:.0f} GB/s, "
             f"{meta['datasheet']['flops'] / 1e12:.1f} TFLOP/s.", "",
             f"Calibrated model error (RMSE / mean step): {100 * prof.calibration_error:.2f}%. "
             f"Compilations during timing: {prof.compilations_during_timing}. Compile time {prof.compile_s:.1f}s.", "",
             "| bucket | context | step ms | device ms | verify ms | plain forward ms | verify / forward | draft ms "
             "| host ms | host % | fixed:b host % | roofline ms | calibrated ms | error % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in prof.points:
        lines.append(f"| {p.bucket} | {p.context} | {_ms(p.step_s)} | {_ms(p.device_s)} | {_ms(p.verify_s)} | "
                     f"{_ms(p.forward_s)} | {p.verify_s / p.forward_s:.2f} | {_ms(p.draft_s)} | {_ms(p.host_s)} | "
                     f"{100 * p.host_s / p.loop_s:.1f} | {100 * p.fixed_host_s / p.fixed_loop_s:.1f} | {_ms(p.roofline_s)} | "
                     f"{_ms(p.calibrated_s)} | {100 * (p.calibrated_s - p.step_s) / p.step_s:+.1f} |")
    lines += ["", "| context | AR step ms |", "|---|---|"]
    lines += [f"| {c} | {_ms(t)} |" for c, t in prof.ar_step_s.items()]
    return "\n".join(lines) + "\n"


def plot(prof: Profile, path: Path, title: str) -> None:
    """Left: step latency vs bucket, one colour per context (measured solid, roofline dashed,
    calibrated dotted). Right: the step's parts at the longest context."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    contexts = sorted({p.context for p in prof.points})
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colours = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, len(contexts)))
    for c, colour in zip(contexts, colours):
        pts = sorted((p for p in prof.points if p.context == c), key=lambda p: p.bucket)
        xs = [p.bucket for p in pts]
        ax.plot(xs, [p.step_s * 1e3 for p in pts], "o-", color=colour, label=f"c={c} measured")
        ax.plot(xs, [p.roofline_s * 1e3 for p in pts], "--", color=colour, label=f"c={c} roofline")
        ax.plot(xs, [p.calibrated_s * 1e3 for p in pts], ":", color=colour, alpha=0.8)
    ax.set(yscale="log", xlabel="bucket (tree nodes verified)", ylabel="step latency (ms)",
           title="step: measured (solid), roofline (dashed), calibrated (dotted)")
    ax.legend(fontsize=7, ncol=2)
    last = sorted((p for p in prof.points if p.context == contexts[-1]), key=lambda p: p.bucket)
    xs = [p.bucket for p in last]
    for attr, label in (("step_s", "full step"), ("device_s", "device (back to back)"), ("verify_s", "verify only"),
                        ("draft_s", "draft + tree build"), ("host_s", "host overhead (<= 0 not drawn)")):
        ys = [getattr(p, attr) * 1e3 if getattr(p, attr) > 0 else math.nan for p in last]
        ax2.plot(xs, ys, "o-", label=label)
    if contexts[-1] in prof.ar_step_s:
        ax2.axhline(prof.ar_step_s[contexts[-1]] * 1e3, color="grey", ls="--", label="AR step")
    ax2.set(yscale="log", xlabel="bucket", ylabel="ms", title=f"parts of a step at context {contexts[-1]}")
    ax2.legend(fontsize=7)
    buckets = sorted({p.bucket for p in prof.points})
    for a in (ax, ax2):
        if buckets[-1] > buckets[0]:
            a.set_xscale("log", base=2)
        a.set_xticks(buckets, [str(b) for b in buckets])
        a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        a.grid(True, which="major", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out_dir: Path, name: str, meta: dict, prof: Profile, calibration: dict,
                  make_plot: bool = True) -> dict[str, Path]:
    """<name>.calibration.json (LatencyModel.save format), <name>.json (all measurements), <name>.md,
    <name>.png. Returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"calibration": out_dir / f"{name}.calibration.json", "measurements": out_dir / f"{name}.json",
             "table": out_dir / f"{name}.md"}
    paths["calibration"].write_text(json.dumps(calibration, indent=2))
    raw = {"meta": meta, "cache_len": prof.cache_len, "compile_s": prof.compile_s,
           "compilations_during_timing": prof.compilations_during_timing,
           "calibration_rmse_over_mean": prof.calibration_error,
           "ar_step_s": {str(c): t for c, t in prof.ar_step_s.items()},
           "points": [dataclasses.asdict(p) for p in prof.points]}
    paths["measurements"].write_text(json.dumps(raw, indent=2))
    title = f"{meta['label']} on {meta['device']} ({meta['dtype']})"
    paths["table"].write_text(markdown(title, meta, prof))
    if make_plot:
        paths["plot"] = out_dir / f"{name}.png"
        plot(prof, paths["plot"], title)
    return paths


def device_meta(engine, label: str, model_name: str, reps: int, warmup: int) -> dict:
    import jax

    from bastion_jax.latency import DevicePeaks

    dev = jax.devices()[0]
    return {"device": dev.device_kind, "backend": jax.default_backend(), "date": datetime.date.today().isoformat(),
            "label": label, "model": model_name, "dtype": engine.target.dtype.name, "buckets": list(engine.buckets),
            "block_size": engine.block_size, "target_layers": engine.target.config.num_hidden_layers,
            "layers_layout": engine.target.config.layers_layout,
            "reps": reps, "warmup": warmup, "peaks": dataclasses.asdict(engine.latency.peaks),
            "datasheet": dataclasses.asdict(DevicePeaks.detect())}


