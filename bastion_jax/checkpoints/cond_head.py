"""The optional conditioned head's files beside a drafter checkpoint (`modeling/cond_head.py`).

A z-lab DFlash checkpoint (config.json + model.safetensors) stays exactly that: other DFlash code
reads it unchanged. The head lives beside it in `cond_head.safetensors` (`fc1.weight` [rank, 2h],
`fc1.bias` [rank], `fc2.weight` [h, rank], and `rec.weight` [rank, rank] for a recurrent head) and
`cond_head.json` (`rank`, `hidden_size`, `recurrent`, how it was trained, and a fingerprint of the
drafter it was trained on). Every file is checked against the
drafter before anything is kept: a head of another width, a truncated file or a head trained on
another drafter's hidden states (same shapes, so it would load and quietly draft worse) is refused
in one line, never broadcast or ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from bastion_jax.checkpoints.errors import ConversionError

HEAD_CONFIG = "cond_head.json"
HEAD_WEIGHTS = "cond_head.safetensors"
HEAD_FORMAT = 1


def drafter_fingerprint(params: dict[str, Any]) -> str:
    """Which drafter a head belongs to: a hash of the drafter's `fc` and final `norm` weights rounded
    to bfloat16 (the same for the float32 weights a run trains and the bf16 ones it exports, and for a
    z-lab directory and its conversion)."""
    import hashlib

    h = hashlib.sha256()
    for name in ("fc", "norm"):
        h.update(np.asarray(jnp.asarray(params[name]["weight"], jnp.bfloat16)).view(np.uint16).tobytes())
    return h.hexdigest()[:16]


def default_cond_head() -> bool:
    """Whether a drafter's conditioned head drafts unless told otherwise: yes, on every backend. Off an
    accelerator its sequential spine cost more than it bought while the drafter's own law was trained
    to stand alone (v16: bastion 1.27x AR without the head, 1.24x with it on 64 candidates per slot,
    `benchmarks/results/cpu-smollm2-head-candidates.md`); drafter v17 was trained as a pair with the
    head's loss alone, its head-free law fell behind (chain tau 1.53 against 1.70 for v16) and with the
    head it reads 2.04, so on CPU too the head pays: bastion 1.31x AR against v16's 1.28x without it
    in one session (`benchmarks/results/cpu-smollm2-drafter-v17-ab.md`). Kept as a function: the
    place to decide it per backend again if a drafter ever says otherwise."""
    return True


def has_head(path: str | Path) -> bool:
    """Whether a drafter directory ships a conditioned head (its config file names one)."""
    return (Path(path) / HEAD_CONFIG).is_file()


def head_shapes(hidden_size: int, rank: int, recurrent: bool = False) -> dict[str, dict[str, tuple[int, ...]]]:
    shapes = {"fc1": {"weight": (rank, 2 * hidden_size), "bias": (rank,)}, "fc2": {"weight": (hidden_size, rank)}}
    return {**shapes, "rec": {"weight": (rank, rank)}} if recurrent else shapes


def read_head(path: str | Path, hidden_size: int, drafter: dict[str, Any] | None = None
              ) -> tuple[int, dict[str, dict[str, np.ndarray]]]:
    """(rank, the head's tensors as a nested dict, "rec" among them for a recurrent head) of the head
    beside drafter dir `path`, checked against the drafter's `hidden_size` and, given its parameters
    (`drafter`, a nested dict), the fingerprint the head was exported with. Raises ConversionError with one line naming the problem."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    try:
        meta = json.loads((path / HEAD_CONFIG).read_text())
        rank, width = int(meta["rank"]), int(meta["hidden_size"])
        recurrent = meta.get("recurrent", False)
        if not isinstance(recurrent, bool):
            raise ValueError(f"recurrent must be true or false, got {recurrent!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConversionError(f"unreadable conditioned-head config {path / HEAD_CONFIG}: {e}") from None
    if meta.get("format", HEAD_FORMAT) != HEAD_FORMAT:
        raise ConversionError(f"{path / HEAD_CONFIG}: unknown head format {meta.get('format')!r}")
    if width != hidden_size or rank <= 0:
        raise ConversionError(f"conditioned head {path / HEAD_CONFIG} (hidden_size {width}, rank {rank}) does not fit "
                              f"this drafter (hidden_size {hidden_size})")
    want = meta.get("drafter_fingerprint")
    if want is not None and drafter is not None and drafter_fingerprint(drafter) != want:
        raise ConversionError(f"conditioned head {path / HEAD_CONFIG} was trained on another drafter's hidden states "
                              f"(fingerprint {want}, this drafter's {drafter_fingerprint(drafter)}): retrain it "
                              "(train_drafter train --cond-head R --freeze-drafter) or draft without it (--cond-head off)")
    try:
        flat = load_file(str(path / HEAD_WEIGHTS))
    except (OSError, SafetensorError) as e:
        raise ConversionError(f"missing or corrupt conditioned-head weights {path / HEAD_WEIGHTS}: {e}") from None
    expected = head_shapes(hidden_size, rank, recurrent)
    names = {f"{m}.{p}" for m, ps in expected.items() for p in ps}
    if set(flat) != names:
        raise ConversionError(f"{path / HEAD_WEIGHTS} holds {sorted(flat)}, expected {sorted(names)}")
    tensors: dict[str, dict[str, np.ndarray]] = {}
    for m, ps in expected.items():
        for p, shape in ps.items():
            a = flat[f"{m}.{p}"]
            if tuple(a.shape) != shape:
                raise ConversionError(f"{path / HEAD_WEIGHTS}: {m}.{p} has shape {tuple(a.shape)}, expected {shape} "
                                      f"(rank {rank}, hidden_size {hidden_size})")
            tensors.setdefault(m, {})[p] = a
    return rank, tensors


def write_head(out: str | Path, head: dict[str, Any], dtype: jnp.dtype = jnp.bfloat16,
               info: dict[str, Any] | None = None, drafter: dict[str, Any] | None = None) -> None:
    """Write a head's nested dict ({"fc1": {"weight", "bias"}, "fc2": {"weight"}}) beside a drafter,
    with the fingerprint of `drafter` (its parameters, a nested dict) when given."""
    from safetensors.numpy import save_file

    out = Path(out)
    w2 = np.asarray(head["fc2"]["weight"])
    tensors = {f"{m}.{p}": np.asarray(jnp.asarray(v, dtype)) for m, ps in head.items() for p, v in ps.items()}
    save_file(tensors, str(out / HEAD_WEIGHTS))
    meta = {"format": HEAD_FORMAT, "rank": int(w2.shape[1]), "hidden_size": int(w2.shape[0]),
            "recurrent": "rec" in head,
            "about": "parent-conditioned output head of this DFlash drafter (bastion_jax/modeling/cond_head.py); "
                     "other DFlash code may ignore it"}
    if drafter is not None:
        meta["drafter_fingerprint"] = drafter_fingerprint(drafter)
    (out / HEAD_CONFIG).write_text(json.dumps({**meta, **(info or {})}, indent=2))


def remove_head(out: str | Path) -> None:
    """Drop a stale head from a directory a drafter without one is exported to."""
    for name in (HEAD_CONFIG, HEAD_WEIGHTS):
        (Path(out) / name).unlink(missing_ok=True)
