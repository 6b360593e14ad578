"""Where does a batched AR decode step's time go? The compiled step alone against the engine's loop.

    python -m benchmarks.ar_batch_probe                              # SmolLM2 shapes, batch 128, cache 768
    python -m benchmarks.ar_batch_probe --batch 4 --cache-len 256 --steps 8 --out-dir /tmp/ab   # smoke (CPU)

Why: on an H100 (2026-11-26) the training-data job (SmolLM2-135M, float32, batch 128, `Engine`
in AR mode) took ~0.3 s per decode step, compile excluded, and the compiled step does not copy
its KV cache (its scratch memory is flat in the cache length: `compile_probe`). This separates the
candidates in one short run, random weights of the architecture's shapes:

  step[xla] / step[pallas]  the jitted `decoding.decode` alone, each prefix-attention mode, timed
                            back to back with one read at the end (the device's own time per step)
  step-read[...]            the same with the token read back every step (what a loop that waits
                            for each token pays)
  engine                    `Engine.generate(mode="ar")` over the same batch (its decode seconds per
                            step: look-ahead dispatch, one read per step, the host's bookkeeping)

Writes <name>.json and <name>.md (device, date, commit, milliseconds per step).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

from benchmarks.report import commit


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="smollm2-135m", help="named architecture (bastion_jax.presets)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N target layers")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    p.add_argument("--cache-len", type=int, default=768)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per variant")
    p.add_argument("--modes", default="xla,pallas", help="prefix attention modes (pallas needs a GPU)")
    p.add_argument("--name", default=None)
    p.add_argument("--out-dir", default="benchmarks/results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bastion_jax import decoding
    from bastion_jax.checkpoints import layer_layout
    from bastion_jax.engine import Engine
    from bastion_jax.modeling.attention import set_prefix_kernel
    from bastion_jax.modeling.cache import KVCache
    from bastion_jax.presets import preset_configs, random_models
    from bastion_jax.sampling import SamplingConfig, sampler
    from bastion_jax.step_config import StepConfig

    backend = jax.default_backend()
    dtype = getattr(jnp, args.dtype)
    tcfg, _ = preset_configs(args.arch, args.layers)
    tcfg = layer_layout(tcfg, dtype=dtype)
    target, _ = random_models(tcfg, None, dtype)
    b, n = args.batch, args.steps
    if args.prompt + n + 2 > args.cache_len:
        raise SystemExit(f"--cache-len {args.cache_len} is shorter than --prompt + --steps + 2")
    cfg = StepConfig(target_def=target.graphdef)
    key = sampler(jax.random.PRNGKey(0), SamplingConfig())
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, tcfg.vocab_size, (b, args.prompt)).astype(np.int32)
    rows: dict[str, float] = {}

    modes = [m for m in args.modes.split(",") if m and (m != "pallas" or backend == "gpu")]
    for mode in modes:
        old = set_prefix_kernel(mode)
        try:
            cache = KVCache.create(tcfg, b, args.cache_len, dtype)
            lengths = jnp.full((b,), args.prompt, jnp.int32)
            cache, first = decoding.prefill(cfg, target.state, cache, jnp.asarray(prompts), lengths, key)
            cache, tok = decoding.decode(cfg, target.state, cache, first, lengths, key)  # compile
            jax.block_until_ready(tok)
            for read_each in (False, True):
                t0 = time.perf_counter()
                for i in range(n):
                    cache, tok = decoding.decode(cfg, target.state, cache, tok, lengths + 1 + i, key)
                    if read_each:
                        np.asarray(tok)
                jax.block_until_ready(tok)
                rows[f"step{'-read' if read_each else ''}[{mode}]"] = (time.perf_counter() - t0) / n * 1e3
                print(f"{list(rows)[-1]}: {rows[list(rows)[-1]]:.2f} ms/step", flush=True)
        finally:
            set_prefix_kernel(old)

    engine = Engine(target, stop_ids=[-1])
    ids = [list(p) for p in prompts]
    engine.generate(ids, max_new_tokens=4)  # compile
    res = engine.generate(ids, max_new_tokens=n + 1)
    rows["engine"] = res.stats.decode_s / max(res.stats.steps, 1) * 1e3
    print(f"engine: {rows['engine']:.2f} ms/step ({res.stats.steps} steps)", flush=True)

    device = jax.devices()[0].device_kind
    meta = {"device": device, "backend": backend, "date": datetime.date.today().isoformat(), "commit": commit(),
            "arch": args.arch, "layers": tcfg.num_hidden_layers, "scan": tcfg.scan_layers, "dtype": args.dtype,
            "batch": b, "prompt": args.prompt, "cache_len": args.cache_len, "steps": n}
    name = args.name or f"{backend}-{args.arch}-ar-batch{b}"
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "ms_per_step": rows}, indent=2) + "\n")
    lines = [f"# {name}", "", f"{device}, {meta['date']}, commit {meta['commit']}, {args.arch} shapes "
             f"({meta['layers']} layers, {'scanned' if meta['scan'] else 'unrolled'}), {args.dtype}, random weights, "
             f"batch {b}, prompt {args.prompt}, cache {args.cache_len}; milliseconds per decode step over {n} steps.",
             "", "| variant | ms / step |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in rows.items()]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
