"""bastion_jax against the PyTorch originals: the same pair, prompts, budget and machine, in one run.

    python -m benchmarks.torch_originals --originals DIR --python VENV/bin/python \
        --prompts mt_bench gsm8k_test humaneval --max-prompts 4 --name cpu-smollm2-vs-torch

`--originals`: a checkout of z-lab/dflash, or of kaist-ai-osi-lab/BASTION, which carries the same
`dflash/model.py` and adds `torch:bastion`, the official `bastion_generate` calibrated on this CPU as
its own benchmark calibrates on a GPU (`benchmarks/torch_side.py`). `dflash_generate` runs AR (block
size 1) and the DFlash chain on the transformers model of the embedded default target (its GGUF,
dequantised by transformers) with the shipped drafter, read as the z-lab checkpoint it is. `--python`: the interpreter of an environment
holding torch and transformers 4.57 (the originals' pin; transformers 5 changed the KV cache's
`crop`), since ours installs transformers 5 for its tests:

    python -m venv VENV && VENV/bin/pip install torch==2.13.0 transformers==4.57.1 gguf accelerate

The originals run in that interpreter (`benchmarks/torch_side.py`) while nothing of ours runs, and
then ours: `ar`; `dflash` with what the originals draft with (the drafter's own head-free law over
the full vocabulary, no context lookup), whose text must equal theirs; and `bastion` as
`generate` runs it by default (conditioned head, reduced draft vocabulary, lookup, datastore,
calibrated). Per prompt the median-time of `--reps` runs, wall clock around the whole call (prefill
included) on both sides. Reports tokens/s, tau, the ratio to each side's AR and whether the texts
match; writes <name>.json and .md under benchmarks/results with device, date, commit and versions.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bastion_jax.cli import Parser, fail, positive_int, use_compilation_cache
from bastion_jax.acceptance import STANDARD_SETS, PromptError, read_prompts, resolve_prompt_file
from benchmarks.report import commit, write_results

RESULTS = Path(__file__).resolve().parent / "results"
TORCH_SIDE = Path(__file__).resolve().parent / "torch_side.py"


def parse(argv):
    p = Parser(prog="python -m benchmarks.torch_originals",
               description="bastion_jax against z-lab's PyTorch DFlash code on the embedded default pair")
    p.add_argument("--originals", help="a checkout of z-lab/dflash (its dflash/model.py) or of BASTION")
    p.add_argument("--report", metavar="JSON", help="only rewrite a saved run's summary and markdown (beside it)")
    p.add_argument("--python", default=sys.executable,
                   help="interpreter with torch + transformers 4.57 for the originals (default: this one)")
    p.add_argument("--prompts", nargs="+", default=["mt_bench", "gsm8k_test", "humaneval"],
                   help=f"standard sets ({', '.join(STANDARD_SETS)}) or JSONL(.gz) files")
    p.add_argument("--max-prompts", type=positive_int, default=4, help="prompts per set")
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    p.add_argument("--reps", type=positive_int, default=2, help="runs per mode and prompt (the median is kept)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both sides compute in it")
    p.add_argument("--threads", type=positive_int, default=os.cpu_count(), help="torch's CPU threads")
    p.add_argument("--max-tree", type=positive_int, default=256,
                   help="the official BASTION's largest tree (its calibration grid's longest verify)")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--name", default=None, help="results file stem (default cpu-smollm2-vs-torch-<dtype>-<date>)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.report:
        return report(Path(args.report))
    if args.originals is None:
        return fail(ValueError("--originals is required (a checkout of z-lab/dflash or of BASTION)"))
    if not (Path(args.originals) / "dflash" / "model.py").is_file():
        return fail(ValueError(f"--originals {args.originals}: no dflash/model.py there (a checkout of z-lab/dflash)"))
    try:
        prompts = [(Path(f).name.split(".")[0], text) for spec in args.prompts
                   for f in [resolve_prompt_file(spec)] for text in read_prompts(f, args.max_prompts)]
    except PromptError as e:
        return fail(e)
    try:
        check = subprocess.run([args.python, str(TORCH_SIDE), "--check", str(Path(args.originals).resolve())],
                               capture_output=True, text=True)
    except OSError as e:
        return fail(ValueError(f"--python {args.python}: cannot run it ({e.strerror or e})"))
    if check.returncode:
        return fail(ValueError(last_line(check.stderr)))
    use_compilation_cache()
    try:
        return measure(args, prompts)
    except ValueError as e:  # CheckpointError, DefaultModelError, GenerationError, ...
        return fail(e)


def theirs(args, job: dict) -> dict:
    """The originals' rows, run in `--python`'s environment; its one-line error ends this run."""
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(job))
        # Its progress is passed on as it comes; its `error:` line (or a traceback's last line) becomes ours.
        with subprocess.Popen([args.python, str(TORCH_SIDE), str(job_file), str(out_file)], stderr=subprocess.PIPE,
                              text=True) as child:
            seen = []
            for line in child.stderr:
                seen.append(line)
                if not line.startswith("error:"):
                    print(line, end="", file=sys.stderr, flush=True)
        if child.returncode:
            raise ValueError(last_line("".join(seen)))
        return json.loads(out_file.read_text())


def last_line(stderr: str) -> str:
    """What the originals' side said last (its `error:` line, or a traceback's last line), as our reason."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()] or ["?"]
    last = lines[-1]
    return last[len("error: "):] if last.startswith("error: ") else f"the originals' run failed: {last}"


def measure(args, prompts: list[tuple[str, str]]) -> int:
    import jax
    import jax.numpy as jnp

    from bastion_jax import Engine, encode_prompt, load_drafter, load_target, load_tokenizer
    from bastion_jax.default_model import default_drafter_dir, default_gguf, default_target_dir
    from bastion_jax.hardware import cpu_name
    from bastion_jax.text import stop_ids

    dtype = jnp.dtype(args.dtype)
    target = load_target(default_target_dir(), dtype)
    tok = load_tokenizer(target)
    ids = [encode_prompt(tok, text) for _, text in prompts]
    stops = sorted(stop_ids(tok, target.config.eos_token_ids))
    job = {"originals": str(Path(args.originals).resolve()), "gguf": str(default_gguf()),
           "drafter": str(default_drafter_dir()), "prompts": ids, "stop_ids": stops,
           "max_new_tokens": args.max_new_tokens, "reps": args.reps, "dtype": args.dtype, "threads": args.threads,
           "max_tree": args.max_tree}
    print(f"the originals ({args.python}) on {len(ids)} prompts ...", file=sys.stderr, flush=True)
    torch_run = theirs(args, job)

    # The originals' law: the drafter without its conditioned head, over the full vocabulary, no lookup.
    plain = Engine(target, tok, drafter=load_drafter(default_drafter_dir(), target.config, dtype, cond_head=False),
                   draft_vocab="full", lookup=None, datastore=None)
    default = Engine(target, tok, drafter=load_drafter(default_drafter_dir(), target.config, dtype))
    cache_len = default.cache_len_for([max(map(len, ids))], args.max_new_tokens, None, default.slack("bastion"))
    default.calibrate(cache_len)
    engines = {"ar": plain, "dflash": plain, "bastion": default}
    for mode, engine in engines.items():  # untimed warm-up at the measured shapes
        engine.generate(ids[:1], max_new_tokens=8, mode=mode, max_len=cache_len)
    rows = [dict(r, source=prompts[r["prompt"]][0]) for r in torch_run["rows"]]
    for i, prompt in enumerate(ids):
        for mode, engine in engines.items():
            runs = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                res = engine.generate([prompt], max_new_tokens=args.max_new_tokens, mode=mode, max_len=cache_len)
                runs.append((time.perf_counter() - t0, res))
            seconds, res = sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]
            rows.append({"prompt": i, "source": prompts[i][0], "mode": mode, "tokens": res.tokens[0],
                         "seconds": seconds, "ttft_s": res.stats.ttft_s, "steps": res.stats.row_steps,
                         "committed": res.stats.committed})
            print(f"ours prompt {i} {mode}: {len(res.tokens[0]) / seconds:.1f} tok/s", file=sys.stderr, flush=True)
    record = {"meta": {"device": jax.devices()[0].device_kind, "cpu": cpu_name(),
                       "date": datetime.date.today().isoformat(), "commit": commit(), "dtype": args.dtype,
                       "max_new_tokens": args.max_new_tokens, "reps": args.reps, "prompts": len(ids),
                       "sets": list(dict.fromkeys(s for s, _ in prompts)), "jax": jax.__version__,
                       "torch": torch_run["torch"], "transformers": torch_run["transformers"],
                       "torch_threads": torch_run["threads"], "originals": describe(args.originals),
                       "official_bastion": torch_run["official_bastion"]},
              "summary": summarise(rows), "rows": rows}
    name = args.name or f"cpu-smollm2-vs-torch-{args.dtype}-{record['meta']['date']}"
    write_results(args.out_dir, name, record, markdown(record))
    return 0


def report(path: Path) -> int:
    """Summary and markdown of a saved run made again from its rows (a report that changed since)."""
    try:
        record = json.loads(path.read_text())
        record["summary"] = summarise(record["rows"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return fail(ValueError(f"--report {path}: not a torch_originals run ({e})"))
    write_results(path.parent, path.stem, record, markdown(record))
    return 0


def describe(path: str) -> str:
    """The originals' checkout as `<its directory's name> @ <commit>`, so the figures name what they ran."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        sha = "unknown commit"
    return f"{Path(path).resolve().name} @ {sha}"


def summarise(rows: list[dict]) -> dict:
    """Per set and overall ("all"), per mode: tokens/s (tokens over seconds, pooled), tau (committed
    per step), the ratios to the originals' AR and to ours, how many answers equal their own side's AR
    text (greedy decoding's: a lossless mode must give it) and how many equal the originals' AR text
    (the two libraries agree in float32; in bfloat16 their roundings differ)."""
    ar = {side: {r["prompt"]: r["tokens"] for r in rows if r["mode"] == side} for side in ("torch:ar", "ar")}
    out: dict[str, dict] = {}
    for src in ["all", *dict.fromkeys(r["source"] for r in rows)]:
        mine = [r for r in rows if src in ("all", r["source"])]
        cells = {}
        for mode in dict.fromkeys(r["mode"] for r in rows):  # the originals' modes first, then ours
            m = [r for r in mine if r["mode"] == mode]
            tokens, seconds = sum(len(r["tokens"]) for r in m), sum(r["seconds"] for r in m)
            own = ar["torch:ar" if mode.startswith("torch:") else "ar"]
            cells[mode] = {"tokens_per_s": tokens / seconds, "tau": sum(r["committed"] for r in m) / sum(r["steps"] for r in m),
                           "same_text_as_own_ar": sum(r["tokens"] == own[r["prompt"]] for r in m),
                           "same_text_as_torch_ar": sum(r["tokens"] == ar["torch:ar"][r["prompt"]] for r in m),
                           "answers": len(m)}
        for mode, cell in cells.items():
            cell["ratio_to_torch_ar"] = cell["tokens_per_s"] / cells["torch:ar"]["tokens_per_s"]
            cell["ratio_to_our_ar"] = cell["tokens_per_s"] / cells["ar"]["tokens_per_s"]
        out[src] = cells
    return out


def markdown(record: dict) -> str:
    meta, summary = record["meta"], record["summary"]
    lines = [f"# bastion_jax against the PyTorch originals ({meta['dtype']})", "",
             f"{meta['device']} ({meta['cpu']}), {meta['date']}, commit {meta['commit']}; jax {meta['jax']}; "
             f"originals: {meta['originals']} on torch {meta['torch']} ({meta['torch_threads']} threads), "
             f"transformers {meta['transformers']}. Default pair (SmolLM2-135M-Instruct Q4_1 GGUF target, the "
             f"shipped drafter as its z-lab checkpoint), {meta['prompts']} prompts ({', '.join(meta['sets'])}), "
             f"{meta['max_new_tokens']} new tokens, T=0, median of {meta['reps']} runs per prompt, wall clock "
             "around each whole call (prefill included).", "",
             "`torch:ar` / `torch:dflash`: z-lab's `dflash_generate` at block size 1 / the drafter's"
             + ("; `torch:bastion`: the official `bastion_generate`, calibrated on this CPU as its benchmark does "
                f"(trees of up to {meta['official_bastion']['max_tree_size']} nodes)" if meta.get("official_bastion")
                else "") + ". `dflash`: ours with the originals' drafter law (no conditioned head, full vocabulary, "
             "no lookup). `bastion`: ours as `generate` runs it. tau: tokens committed per step (the originals "
             "count a last step's tokens past the budget too).", "",
             "| mode | tokens/s | tau | x torch:ar | x our ar | same text as its side's AR | same text as torch:ar |",
             "|---|---|---|---|---|---|---|"]
    for mode, c in summary["all"].items():
        lines.append(f"| {mode} | {c['tokens_per_s']:.1f} | {c['tau']:.2f} | {c['ratio_to_torch_ar']:.2f} | "
                     f"{c['ratio_to_our_ar']:.2f} | {c['same_text_as_own_ar']}/{c['answers']} | "
                     f"{c['same_text_as_torch_ar']}/{c['answers']} |")
    modes = list(summary["all"])
    lines += ["", "tokens/s per set (tau):", "", "| set | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for src, cells in summary.items():
        if src != "all":
            lines.append(f"| {src} | " + " | ".join(f"{cells[m]['tokens_per_s']:.1f} ({cells[m]['tau']:.2f})"
                                                    for m in modes) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
