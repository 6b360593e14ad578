"""The PyTorch originals' half of `benchmarks.torch_originals`: z-lab's `dflash_generate` (AR at block
size 1, the DFlash chain at the drafter's block size) on the transformers target, timed per prompt.

    python benchmarks/torch_side.py JOB.json OUT.json

Run by `benchmarks.torch_originals` with the interpreter of the originals' own environment (torch +
transformers 4.57, which z-lab's code was written for: transformers 5 changed `DynamicCache.crop`),
so it imports nothing from bastion_jax and reads everything it needs from the job file: the
originals' checkout, the target's GGUF, the drafter's z-lab directory, the prompts as token ids
(encoded once, by the driver, so both sides decode the same ids), the stop ids, the budget, the
dtype, the thread count and the repeats. Writes each prompt's median-time run per mode.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(job_path: str, out_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    try:
        import torch
        import transformers
    except ImportError as e:
        return fail(f"the originals need torch and transformers in {sys.executable}'s environment ({e})")
    if int(transformers.__version__.split(".")[0]) >= 5:
        return fail(f"z-lab's DFlash code needs transformers < 5 (its DynamicCache.crop calls changed meaning), "
                    f"{sys.executable} has {transformers.__version__}: pass --python of an environment with "
                    "transformers==4.57.1")
    sys.path.insert(0, job["originals"])
    try:
        import dflash.model as zlab
    except ImportError as e:
        return fail(f"cannot import dflash.model from {job['originals']} ({e})")
    # Their stats clock synchronises CUDA before reading the time; on a CPU every op has finished when
    # it returns, so the plain clock is the same reading.
    zlab._cuda_time = time.perf_counter
    torch.set_num_threads(job["threads"])
    dtype = getattr(torch, job["dtype"])
    gguf = Path(job["gguf"])
    target = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                               dtype=dtype).eval()
    drafter = zlab.DFlashDraftModel.from_pretrained(job["drafter"], dtype=dtype).eval()
    modes = {"torch:ar": 1, "torch:dflash": drafter.block_size}

    def run(ids: list[int], block: int) -> dict:
        t0 = time.perf_counter()
        r = zlab.dflash_generate(drafter, target, torch.tensor([ids]), job["max_new_tokens"], job["stop_ids"], 0.0,
                                 block_size=block, return_stats=True)
        seconds = time.perf_counter() - t0
        return {"tokens": r.output_ids[0, len(ids):].tolist(), "seconds": seconds, "ttft_s": r.time_to_first_token,
                "steps": len(r.acceptance_lengths), "committed": int(sum(r.acceptance_lengths))}

    for block in modes.values():  # untimed: first-run allocations, as the driver warms its own modes up
        run(job["prompts"][0][:64], block)
    rows = []
    for i, ids in enumerate(job["prompts"]):
        for mode, block in modes.items():
            runs = sorted((run(ids, block) for _ in range(job["reps"])), key=lambda r: r["seconds"])
            rows.append({"prompt": i, "mode": mode, **runs[(len(runs) - 1) // 2]})
            print(f"torch prompt {i} {mode}: {len(rows[-1]['tokens']) / rows[-1]['seconds']:.1f} tok/s",
                  file=sys.stderr, flush=True)
    Path(out_path).write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                          "threads": torch.get_num_threads(), "rows": rows}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(fail("usage: python benchmarks/torch_side.py JOB.json OUT.json"))
    sys.exit(main(*sys.argv[1:]))
