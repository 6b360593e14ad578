"""Per-op time of a `jax.profiler` trace (and `StepTracer`, which takes one around a loop's steps): what `train_drafter train --trace` and the benchmarks'
`--trace` write beside the trace (`python -m benchmarks.step_trace DIR` reads one taken elsewhere).

The profiler writes a Chrome trace (`*.trace.json.gz`: `ph` X events with `dur` in microseconds,
`args.hlo_op` / `args.hlo_module` on every op). `summarise` reports, per compiled program, its
executions, device time per execution and the ops with the largest share. On a GPU only the device's
own tracks (`/device:...`) are counted (the host's launch events carry the same op names); on CPU the
ops run on host threads and all are counted, innermost events only (a `while` op spans its body's).
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable

KINDS = (("product", ("gemm", "dot", "cublas", "matmul", "ynn", "cutlass", "onednn")),
         ("attention", ("prefix", "attention", "softmax", "mosaic", "pallas")),
         ("copy", ("copy", "transpose", "dynamic-update-slice", "dynamic_update_slice", "memcpy", "memset")),
         ("reduce", ("reduce",)), ("fusion", ("fusion",)))


def kind(name: str) -> str:
    """A coarse class of an op from its name (first match in KINDS, else "other")."""
    low = name.lower()
    for k, keys in KINDS:
        if any(key in low for key in keys):
            return k
    return "other"


def trace_file(path: str | Path) -> Path:
    """The newest `*.trace.json.gz` under `path` (a profiler log dir) or `path` itself."""
    p = Path(path)
    if p.is_file():
        return p
    found = sorted(p.glob("**/*.trace.json.gz"), key=lambda f: f.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {p}")
    return found[-1]


def op_events(trace: dict) -> list[dict]:
    """The op events of a Chrome trace: complete events (`ph` X) that name an XLA op, on the device's
    own tracks when there are any (GPU), else everywhere (CPU: ops run on host threads); of nested
    events (a `while` op around its body's ops on CPU) only the innermost, so no time counts twice."""
    procs = {e.get("pid"): (e.get("args") or {}).get("name", "") for e in trace.get("traceEvents", [])
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in procs.items() if str(name).startswith("/device:")}
    tracks: dict[tuple, list[dict]] = defaultdict(list)
    for e in trace.get("traceEvents", []):
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args or str(e.get("name", "")).startswith("end: "):
            continue
        if device and e.get("pid") not in device:
            continue
        tracks[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for evs in tracks.values():  # leaves only: a loop's or a call's event spans its body's ops (CPU)
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        for e, nxt in zip(evs, evs[1:] + [None]):
            if nxt is None or float(nxt["ts"]) >= float(e["ts"]) + float(e.get("dur", 0.0)):
                out.append(e)
    return out


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+) = (?P<shape>\([^=]*?\)|\S+) (?P<opcode>[\w-]+)\(")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")


def hlo_details(text: str) -> tuple[str, dict[str, str]]:
    """(module name, {instruction: "opcode shape file:line function"}): `hlo_ops` joined for reading."""
    module, ops = hlo_ops(text)
    return module, {name: " ".join(x for x in fields if x) for name, fields in ops.items()}


def hlo_ops(text: str) -> tuple[str, dict[str, tuple[str, str, str]]]:
    """(module name, {instruction: (opcode, shape, source)}) from a compiled program's HLO
    text (`Compiled.as_text()`): what an op of the trace is, in shapes and the source line it came
    from (the innermost frame of its `stack_frame_id`, through the text's FileNames / FunctionNames /
    FileLocations / StackFrames tables)."""
    lines = text.splitlines()
    module = lines[0].split()[1].rstrip(",") if lines and lines[0].startswith("HloModule") else "?"
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in lines[1:]:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        m = _TABLE_ROW.match(line) if current is not None else None
        if m:
            current[int(m.group(1))] = m.group(2)
        elif line.strip():
            current = None
    def field(row: str, key: str) -> int:
        m = re.search(key + r"=(\d+)", row)
        return int(m.group(1)) if m else 0

    def where(frame: int) -> str:
        loc = tables.get("FileLocations", {}).get(field(tables.get("StackFrames", {}).get(frame, ""), "file_location_id"))
        if loc is None:
            return ""
        file = tables.get("FileNames", {}).get(field(loc, "file_name_id"), "?").strip('"')
        func = tables.get("FunctionNames", {}).get(field(loc, "function_name_id"), "?").strip('"')
        return f"{Path(file).name}:{field(loc, 'line')} {func}"

    instrs = [(m, line) for line in lines if (m := _INSTR.match(line))]  # every instruction, parsed once
    params = {}  # an entry parameter's instruction name -> the argument path JAX named it by
    for m, line in instrs:
        named = re.search(r'op_name="([^"]+)"', line) if m.group("opcode") == "parameter" else None
        if named:
            params[m.group("name")] = _arg_path(named.group(1))
    details = {}
    for m, line in instrs:
        if m.group("opcode") == "parameter":
            continue
        # layouts and spaces dropped: f32[4,512]{1,0} -> f32[4,512], (f32[4], s8[64]) -> (f32[4],s8[64])
        shape = re.sub(r"\s+", "", re.sub(r"\{[^}]*\}", "", m.group("shape")))
        frame = re.search(r"stack_frame_id=(\d+)", line)
        source = where(int(frame.group(1))) if frame else ""
        if not source:  # an op XLA made itself (no metadata): name the arguments it reads, when it reads any
            reads = [params[n] for n in re.findall(r"%([^\s,)]+)", line[m.end():]) if n in params]
            source = "<- " + ", ".join(reads) if reads else ""
        details[m.group("name")] = (m.group("opcode"), shape, source)
    return module, details


def _arg_path(op_name: str) -> str:
    """An entry parameter's `op_name` -> a dotted path: `target_state['layers'][8]['mlp']['up_proj']['weight']`
    -> `target_state.layers.8.mlp.up_proj.weight` (the step's argument and the pytree path in it)."""
    return re.sub(r"\[\\?'?([^\]'\\]+)\\?'?\]", r".\1", op_name)


def load_hlo(log_dir: Path) -> dict[str, dict[str, tuple[str, str, str]]]:
    """{module: hlo_ops} of every `*.hlo.txt.gz` in `log_dir` (written beside a trace by `take`)."""
    out = {}
    for f in sorted(log_dir.glob("*.hlo.txt.gz")):
        with gzip.open(f, "rt") as fp:
            module, details = hlo_ops(fp.read())
        out[module] = details
    return out


def summarise(path: str | Path, top: int = 25) -> dict:
    """Per program (`hlo_module`): executions (the most common count among its ops: an op outside a
    loop runs once per execution), device time per execution (the sum of its ops' durations; kernels
    on parallel streams would count twice), the span per execution (first op start to last op end,
    gaps included) and its `top` ops by total time, with their share and kind."""
    f = trace_file(path)
    with gzip.open(f, "rt") as fp:
        events = op_events(json.load(fp))
    hlo = load_hlo(Path(path)) if Path(path).is_dir() else {}
    per_module: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        per_module[e["args"].get("hlo_module", "?")].append(e)
    modules = {}
    for module, evs in per_module.items():
        counts = Counter(e["args"]["hlo_op"] for e in evs)
        runs = Counter(counts.values()).most_common(1)[0][0]
        total = sum(float(e.get("dur", 0.0)) for e in evs)
        by_run: dict[str, list[dict]] = defaultdict(list)
        for e in evs:
            by_run[e["args"].get("run_id", "")].append(e)
        spans = [max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in r) - min(float(e["ts"]) for e in r)
                 for key, r in by_run.items() if key]
        ops: dict[str, dict] = {}
        for e in evs:
            op = e["args"]["hlo_op"]
            if op not in ops:
                fields = hlo.get(module, {}).get(op, ("", "", ""))
                name = e.get("name", op)
                ops[op] = {"op": op, "kernel": name, "us": 0.0, "calls": 0, "kind": kind(name + " " + op),
                           "detail": " ".join(x for x in fields if x), "source": fields[2]}
            ops[op]["us"] += float(e.get("dur", 0.0))
            ops[op]["calls"] += 1
        ranked = sorted(ops.values(), key=lambda o: -o["us"])
        kinds: dict[str, float] = defaultdict(float)
        sources: dict[str, float] = defaultdict(float)  # op time by the source line it came from
        for o in ranked:
            kinds[o["kind"]] += o["us"]
            sources[re.sub(r"\.\d+\.", ".*.", o["source"]) or "(no source line)"] += o["us"]  # layers.8. -> layers.*.
        modules[module] = {
            "executions": runs, "ops": len(ops), "op_events": len(evs), "device_us_per_execution": total / runs,
            "span_us_per_execution": (sum(spans) / len(spans)) if spans else None,
            "kinds_us_per_execution": {k: v / runs for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "sources_us_per_execution": ({k: v / runs for k, v in sorted(sources.items(), key=lambda kv: -kv[1])[:top]}
                                         if hlo.get(module) else {}),
            "top": [dict(o, us_per_execution=o["us"] / runs, share=o["us"] / total if total else 0.0)
                    for o in ranked[:top]]}
    return {"trace": str(f), "modules": dict(sorted(modules.items(), key=lambda kv: -kv[1]["device_us_per_execution"]))}


def markdown(s: dict, title: str = "Step trace") -> str:
    lines = [f"# {title}", "", f"From `{s['trace']}` (`python -m benchmarks.step_trace`): device time per "
             "execution = the sum of the program's op durations over its executions; span = first op start "
             "to last op end (gaps between kernels included).", ""]
    largest = max((m["device_us_per_execution"] for m in s["modules"].values()), default=0.0)
    small = [k for k, m in s["modules"].items() if m["device_us_per_execution"] < 0.01 * largest]
    if small:  # eager one-op programs (a learning-rate update's arithmetic, a key split): named, not tabled
        lines += [f"Under 1% of the largest program's time, not listed: {', '.join(small)}.", ""]
    for module, m in s["modules"].items():
        if module in small:
            continue
        span = "n/a" if m["span_us_per_execution"] is None else f"{m['span_us_per_execution'] / 1e3:.3f} ms"
        kinds = ", ".join(f"{k} {v / 1e3:.3f}" for k, v in m["kinds_us_per_execution"].items())
        lines += [f"## {module}", "", f"{m['executions']} executions, {m['ops']} ops; device time "
                  f"{m['device_us_per_execution'] / 1e3:.3f} ms per execution, span {span}; by kind (ms): {kinds}.",
                  "", "| op | kernel | kind | ms per execution | share | calls | what (HLO: opcode, shape, source) |",
                  "|---|---|---|---|---|---|---|"]
        for o in m["top"]:
            lines.append(f"| {o['op']} | {o['kernel'][:60]} | {o['kind']} | {o['us_per_execution'] / 1e3:.4f} | "
                         f"{o['share']:.1%} | {o['calls']} | {o.get('detail', '')[:100]} |")
        if m.get("sources_us_per_execution"):
            total = m["device_us_per_execution"]
            lines += ["", "By source line (every op of the program):", "", "| source | ms per execution | share |",
                      "|---|---|---|"]
            lines += [f"| {k} | {v / 1e3:.4f} | {v / total:.1%} |" for k, v in m["sources_us_per_execution"].items()]
        lines.append("")
    return "\n".join(lines)


def write(log_dir: str | Path, title: str, **extra) -> dict:
    """Summarise the newest trace under `log_dir` into `log_dir`/step-trace.json and .md; returns it."""
    log_dir = Path(log_dir)
    s = summarise(log_dir)
    s.update(extra)
    (log_dir / "step-trace.json").write_text(json.dumps(s, indent=2) + "\n")
    (log_dir / "step-trace.md").write_text(markdown(s, title))
    return s


class StepTracer:
    """`jax.profiler` around steps [first, first + steps) of a loop (counted from 0: the trainer's
    `fit(trace_dir=...)`), then the per-op summary beside the trace; inert without a directory."""

    def __init__(self, log_dir: str | Path | None, first: int, steps: int, log: Callable[[str], None]):
        self.log_dir, self.first, self.steps, self.log, self.on = log_dir, first, steps, log, False
        self.traced = 0

    def before(self, done: int) -> None:
        if self.log_dir is not None and done == self.first:
            import jax

            jax.profiler.start_trace(str(self.log_dir))
            self.on = True

    def after(self, done: int) -> None:
        if self.on:
            self.traced = done - self.first
            if done == self.first + self.steps:
                self.close()

    def close(self) -> None:
        if not self.on:
            return
        import jax

        jax.profiler.stop_trace()
        self.on = False
        try:  # a summary that fails costs the summary, never the run it watched
            s = write(self.log_dir, f"Training steps {self.first + 1}-{self.first + self.traced} of this run",
                      steps=self.traced)
        except Exception as e:  # noqa: BLE001
            self.log(f"traced {self.traced} steps into {self.log_dir}, not summarised: {e}")
            return
        per = ", ".join(f"{m} {v['device_us_per_execution'] / 1e3:.1f} ms" for m, v in list(s["modules"].items())[:4])
        self.log(f"traced {self.traced} training steps into {self.log_dir}: {per} (step-trace.md)")
