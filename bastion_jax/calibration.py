"""Where a latency calibration lives and when it is made: reused when one was saved for exactly
this setting, else profiled (and saved) now.

The key names the models as they resolve on disk, the device, dtype, buckets and tree width, so
`generate` and `profile --install` agree however a path is spelled, and a run never reuses a fit
made for something else.
"""

from __future__ import annotations

import time


def calibration_model(target, drafter, draft_vocab=None, lookup: bool = True, datastore=None,
                      cond_depths: int = 0, cond_candidates: int = 0) -> str:
    """The models part of the calibration key: the target's and the drafter's files as they resolve on
    disk (`model_identity`), so `generate` and `profile --install` agree however a path is spelled,
    the target's layer layout, the draft vocabulary's size (it sets the price of a draft) and
    whether the context lookup runs in the tree steps (`--lookup off` steps cost less), and with a
    datastore of how many tokens (its search is part of every step), and the drafter's conditioned head
    (its rank, the tree depths drawn per parent and the columns it corrects: all price a draft)."""
    from bastion_jax.latency import model_identity

    t = model_identity(target.path) if target.path is not None else "in-memory target"
    cfg = target.config  # how its layers run changes every step's time (`checkpoints.layer_layout`)
    t += f"|{cfg.layers_layout}{'' if cfg.weights_layout == 'out-in' else ' ' + cfg.weights_layout}"
    if drafter is None:
        return f"{t}|none"
    d = model_identity(drafter.path) if drafter.path is not None else "random"
    store = f"|datastore {int(datastore.tokens.shape[0])}" if datastore is not None else ""
    if drafter.config.cond_head_rank:
        rec = " rec" if drafter.config.cond_head_recurrent else ""
        d += f"|cond-head {drafter.config.cond_head_rank}{rec} x{cond_depths}"
        d += f" top {cond_candidates}" if cond_candidates else ""
    return with_lookup(f"{t}|{d}" + (f"|draft-vocab {int(draft_vocab.ids.shape[0])}" if draft_vocab is not None
                                     else "") + store, lookup)


def with_lookup(model: str, lookup: bool) -> str:
    """A calibration model name for steps with or without the context lookup (off: they cost less)."""
    return model if lookup else f"{model}|lookup off"


def calibration_path(engine, model: str):
    from bastion_jax.default_model import cache_root

    key = engine.latency.key(model, engine.target.dtype.name, engine.top_k)
    return cache_root() / "calibration" / f"{key}.json"


def load_or_calibrate(engine, model: str, cache_len: int, sampling, skip: bool, log, prompt_bucket: int = 16,
                      batch: int = 1, refresh: bool = False, progress: bool = False) -> str:
    """Reuse the calibration saved for exactly this setting (unless `refresh`: `--recalibrate`, for a
    saved one taken while the machine was busy), else profile now (unless `skip`), from a
    prefill at `prompt_bucket` (the coming request's, so that its prefill compiles once), with
    `batch` rows: the engine's latency model then prices steps of that many rows (a batch's steps
    cost other multiples of an AR step than one row's, and the key holds the batch size).
    Only a run that profiled writes the file, right after the fit: online (EMA) corrections made
    while generating never reach it. `progress`: say what is coming and show a bar while it
    profiles (minutes of compiling on a small CPU). Returns "reused", "profiled" or "skipped"."""
    engine.latency = engine.latency.for_batch(batch)
    path = calibration_path(engine, model)
    dtype = engine.target.dtype.name
    if skip and refresh:
        raise ValueError("--recalibrate profiles and --no-calibrate does not: give one of them")
    if not refresh and engine.latency.load(path, model, dtype, engine.top_k):
        log(f"latency calibration: reused {path}")
        return "reused"
    if skip:
        log("latency calibration: skipped (roofline + online correction; nothing saved)")
        return "skipped"
    if progress:
        log("latency calibration: none saved for this setting yet: compiling the steps and timing them once "
            "(saved for later runs; minutes on a small CPU the first time, less from the compilation cache)")
    t0 = time.perf_counter()
    samples = engine.calibrate(cache_len, sampling, prompt_bucket=prompt_bucket, batch=batch, progress=progress)
    engine.latency.save(path, model, dtype, engine.top_k)
    log(f"latency calibration: profiled {len(samples)} step timings over buckets "
        f"{','.join(map(str, engine.buckets))}{f' at batch {batch}' if batch > 1 else ''} in "
        f"{time.perf_counter() - t0:.1f}s (saved to {path})")
    return "profiled"
