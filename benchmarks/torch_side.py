"""The PyTorch originals' half of `benchmarks.torch_originals`: z-lab's `dflash_generate` (AR at block
size 1, the DFlash chain at the drafter's block size) on the transformers target, timed per prompt,
and, when the checkout is the official BASTION one (it carries `bastion/` beside the same
`dflash/`), its `bastion_generate` set up as its benchmark sets it up: the target's verify latency
measured over a grid and fitted (`cost_model.collect_calibration_data`, `fit_linear_calibration`),
then the draft and non-verify constants profiled (`benchmark.profile_tree_adaptive_constants`).
Its cost model knows GPUs and Qwen/Llama shapes only, so the target's shapes and this CPU (peak
matmul rate and copy bandwidth, measured here with torch) are added to its tables; the fit then
scales that roofline to the measured times, as it does for a GPU.

    python benchmarks/torch_side.py JOB.json OUT.json
    python benchmarks/torch_side.py --check ORIGINALS     # exit 0 when they can run in this environment

Run by `benchmarks.torch_originals` with the interpreter of the originals' own environment (torch +
transformers 4.57, which z-lab's code was written for: transformers 5 changed `DynamicCache.crop`),
so it imports nothing from bastion_jax and reads everything it needs from the job file: the
originals' checkout, the target's GGUF, the drafter's z-lab directory, the prompts as token ids
(encoded once, by the driver, so both sides decode the same ids), the stop ids, the budget, the
dtype, the thread count and the repeats. Writes each prompt's median-time run per mode.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import time
from pathlib import Path


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def is_bastion_checkout(path: str) -> bool:
    """The official BASTION repository carries `bastion/` beside z-lab's `dflash/`."""
    return (Path(path) / "bastion" / "tree_draft.py").is_file()


def originals(path: str):
    """(torch, transformers, z-lab's dflash.model) from this environment and the checkout at `path`;
    a SystemExit with one `error:` line when they cannot run here."""
    try:
        import torch
        import transformers
    except ImportError as e:
        sys.exit(fail(f"the originals need torch and transformers in {sys.executable}'s environment ({e})"))
    if int(transformers.__version__.split(".")[0]) >= 5:
        sys.exit(fail(f"z-lab's DFlash code needs transformers < 5 (its DynamicCache.crop calls changed meaning), "
                      f"{sys.executable} has {transformers.__version__}: pass --python of an environment with "
                      "transformers==4.57.1"))
    sys.path.insert(0, path)
    try:
        import dflash.model as zlab
    except ImportError as e:
        sys.exit(fail(f"cannot import dflash.model from {path} ({e})"))
    if is_bastion_checkout(path):
        try:
            importlib.import_module("bastion.benchmark")  # (and through it cost_model and tree_draft)
        except ImportError as e:
            sys.exit(fail(f"cannot import the official BASTION code from {path} ({e}; its pyproject lists what it needs)"))
    return torch, transformers, zlab


def main(job_path: str, out_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    torch, transformers, zlab = originals(job["originals"])
    # Their stats clock synchronises CUDA before reading the time; on a CPU every op has finished when
    # it returns, so the plain clock is the same reading.
    zlab._cuda_time = time.perf_counter
    torch.set_num_threads(job["threads"])
    dtype = getattr(torch, job["dtype"])
    gguf = Path(job["gguf"])
    target = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                               dtype=dtype).eval()
    drafter = zlab.DFlashDraftModel.from_pretrained(job["drafter"], dtype=dtype).eval()
    modes = {"torch:ar": functools.partial(zlab.dflash_generate, block_size=1),
             "torch:dflash": functools.partial(zlab.dflash_generate, block_size=drafter.block_size)}
    setup = {}
    if is_bastion_checkout(job["originals"]):
        modes["torch:bastion"], setup = official_bastion(job, torch, target, drafter)

    def run(ids: list[int], generate) -> dict:
        t0 = time.perf_counter()
        r = generate(drafter, target, torch.tensor([ids]), job["max_new_tokens"], job["stop_ids"], 0.0,
                     return_stats=True)
        seconds = time.perf_counter() - t0
        return {"tokens": r.output_ids[0, len(ids):].tolist(), "seconds": seconds, "ttft_s": r.time_to_first_token,
                "steps": len(r.acceptance_lengths), "committed": int(sum(r.acceptance_lengths))}

    for generate in modes.values():  # untimed: first-run allocations, as the driver warms its own modes up
        run(job["prompts"][0], generate)
    rows = []
    for i, ids in enumerate(job["prompts"]):
        for mode, generate in modes.items():
            runs = sorted((run(ids, generate) for _ in range(job["reps"])), key=lambda r: r["seconds"])
            rows.append({"prompt": i, "mode": mode, **runs[(len(runs) - 1) // 2]})
            print(f"torch prompt {i} {mode}: {len(rows[-1]['tokens']) / rows[-1]['seconds']:.1f} tok/s",
                  file=sys.stderr, flush=True)
    Path(out_path).write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                          "threads": torch.get_num_threads(), "official_bastion": setup,
                                          "rows": rows}))
    return 0


def official_bastion(job: dict, torch, target, drafter):
    """(`bastion_generate` with its calibrated constants bound, what the set-up measured). Its stats
    clock and calibration synchronise CUDA, which on a CPU has nothing to wait for."""
    import atexit
    import shutil
    import tempfile
    from types import SimpleNamespace

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    from bastion import benchmark, cost_model, tree_draft

    tree_draft._cuda_time = time.perf_counter
    cfg = target.config
    model, device = "smollm2-135m", "cpu"
    cost_model.MODEL_SPECS[model] = {"display_name": "SmolLM2-135M", "hf_model_name": model, "args": {
        "L": cfg.num_hidden_layers, "h": cfg.hidden_size, "n_q": cfg.num_attention_heads,
        "n_kv": cfg.num_key_value_heads, "d": cfg.head_dim, "h_ffn": cfg.intermediate_size, "V": cfg.vocab_size}}
    peaks = cpu_peaks(torch)
    cost_model.GPU_SPECS[device] = {"display_name": "CPU", **peaks}
    largest = job["max_tree"]
    # The calibration stays on disk while the run lasts: the estimator reads CALIBRATION_JSON_PATH at
    # every tree.
    work = Path(tempfile.mkdtemp(prefix="bastion-official-"))
    atexit.register(shutil.rmtree, work, True)
    probe = cost_model.collect_calibration_data(
        target=target, tokenizer=SimpleNamespace(eos_token_id=job["stop_ids"][0], pad_token_id=None, bos_token_id=None),
        device=torch.device("cpu"), model_name_or_path=model, gpu_type=device, output_path=work / "probe.jsonl",
        sequence_start=16, sequence_stop=largest, sequence_interval=16, context_start=64, context_stop=1024)
    fit = cost_model.fit_linear_calibration(probe)
    (work / "calibration.json").write_text(json.dumps({"fit_parameters": fit}))
    os.environ["CALIBRATION_JSON_PATH"] = str(work / "calibration.json")
    draft_s, other_s = benchmark.profile_tree_adaptive_constants(
        draft_model=drafter, target=target, input_ids=torch.tensor([job["prompts"][0]]),
        block_size=drafter.block_size, temperature=0.0, model_name=model, gpu_type=device)
    generate = functools.partial(tree_draft.bastion_generate, cost_model_name=model, cost_gpu_type=device,
                                 draft_latency_s=draft_s, non_verify_latency_s=other_s, max_tree_size=largest)
    return generate, {"fit": fit, "draft_latency_s": draft_s, "non_verify_latency_s": other_s,
                      "max_tree_size": largest, **peaks}


def cpu_peaks(torch) -> dict:
    """This CPU's matmul rate (a 2048^2 float32 product) and copy bandwidth (a 256 MiB clone), best of
    five, in the units of BASTION's GPU table."""
    a = torch.randn(2048, 2048)
    x = torch.empty(64 << 20)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return {"peak_throughput_bf16": 2 * 2048 ** 3 / best(lambda: a @ a),
            "memory_bandwidth": 2 * x.numel() * 4 / best(lambda: x.clone())}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--check":  # can the originals run here? (before anything loads)
        originals(sys.argv[2])
        sys.exit(0)
    if len(sys.argv) != 3:
        sys.exit(fail("usage: python benchmarks/torch_side.py JOB.json OUT.json | --check ORIGINALS"))
    sys.exit(main(*sys.argv[1:]))
