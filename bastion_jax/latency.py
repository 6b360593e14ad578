"""Latency model: roofline cost of a BASTION step from model dims and device peaks, calibrated per
compiled bucket from measured step times (offline at warm-up, online by EMA), persisted as JSON.

Verify cost follows BASTION's closed forms (spec D.6): FLOPs and bytes of an s-token forward at
context c; the step time is max(compute, memory). The drafter's block forward is added the same
way. Calibration maps the raw roofline of each bucket to measured seconds: t = alpha * raw + beta.

Device peaks come from a datasheet table, or from two micro-benchmarks (`DevicePeaks.measure`: a large
copy for bandwidth, a large matmul for FLOP/s) when the profiler ran: achievable peaks sit below the
datasheet ones on GPUs and match no table on CPUs. The calibration is fitted against the roofline made
with particular peaks, so the saved JSON carries them and loading it adopts them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Iterable

from bastion_jax.hardware import device_kind

# Peak dense bf16 FLOP/s and HBM bytes/s (datasheet values; profiling can measure better ones).
DEVICE_PEAKS = {
    "h100": (989e12, 3350e9),
    "h200": (989e12, 4800e9),
    "a100": (312e12, 1935e9),
    "a6000": (155e12, 768e9),
    "cpu": (2e11, 2e10),
}

# Bump when the compiled steps' costs change (attention, fusion, compaction...): a calibration
# measured on older steps would misprice the new ones, so it is part of the calibration key.
STEPS_VERSION = 9  # 2: attention over the live context only (issue 14); 3: two-pass greedy argmax;
# 4: trees read the top min(top_k, nodes - 1) tokens per depth; 5: bf16 on CPU on XLA:CPU's bf16 kernels;
# 6: a draft projects only the new context rows it needs (4, 8, 16 or 32); 7: tree steps that hold
# (bastion verifying a lookup chain) calibrated as variants of their own (`held`); 8: the K/V cache as
# [layers, b, kv_heads, slots, d] and CPU prefix trips by step shape (128 slots for AR, 64 for trees and drafts);
# 9: the roofline counts the weights a step reads (the embedding table once, as a tied LM head; a draft's
# head on the draft vocabulary's rows), so fits against the old roofline are stale


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
    name: str  # the datasheet key ("h100", "cpu", ...): part of the calibration key, even when measured
    flops: float  # dense FLOP/s
    bandwidth: float  # memory bytes/s (read + written)
    source: str = "datasheet"  # or "measured"

    @classmethod
    def measure(cls, dtype=None, *, copy_bytes: int | None = None, matmul_n: int | None = None,
                reps: int = 5) -> "DevicePeaks":
        """Peaks this device actually reaches: `measure_copy_bandwidth` and `measure_matmul_rate`
        (sizes default by backend: 1 GiB / n = 8192 bf16 on accelerators, 64 MiB / n = 1024 fp32 on CPU)."""
        return cls(cls.detect().name, measure_matmul_rate(matmul_n, dtype, reps=reps),
                   measure_copy_bandwidth(copy_bytes, reps=reps), "measured")

    @classmethod
    def detect(cls) -> "DevicePeaks":
        import jax

        kind = jax.devices()[0].device_kind.lower()
        key = "".join(ch for ch in kind if ch.isalnum())
        for name, (f, bw) in DEVICE_PEAKS.items():
            if name in key:
                return cls(name, f, bw)
        if jax.default_backend() == "cpu":
            return cls("cpu", *DEVICE_PEAKS["cpu"])
        return cls(key or "unknown", *DEVICE_PEAKS["h100"])


def _best_seconds_per_call(fn, x, *args, reps: int, chain: int) -> float:
    """Best of `reps` timings of `chain` dependent calls x = fn(x, *args), dispatched back to back
    and synchronised once, so launch latency hides behind the previous call's device work."""
    import jax

    jax.block_until_ready(fn(x, *args))  # warm-up (the executable is already compiled)
    best = math.inf
    for _ in range(max(1, reps)):
        y = x
        t0 = time.perf_counter()
        for _ in range(chain):
            y = fn(y, *args)
        jax.block_until_ready(y)
        best = min(best, (time.perf_counter() - t0) / chain)
    return best


def measure_copy_bandwidth(nbytes: int | None = None, *, reps: int = 5, chain: int = 8) -> float:
    """Bytes read + written per second by an elementwise pass over a large float32 array
    (x + 1: one read and one write per element, which XLA cannot fold away)."""
    import jax
    import jax.numpy as jnp

    if nbytes is None:
        nbytes = (64 << 20) if jax.default_backend() == "cpu" else (1 << 30)
    n = max(1024, nbytes // 4)
    x = jnp.zeros((n,), jnp.float32)  # [n] on the default device
    fn = jax.jit(lambda a: a + 1.0).lower(x).compile()
    return 2 * n * 4 / _best_seconds_per_call(fn, x, reps=reps, chain=chain)


def measure_matmul_rate(n: int | None = None, dtype=None, *, reps: int = 5, chain: int = 8) -> float:
    """FLOP/s of an n x n matmul (2 n^3 FLOPs) in `dtype` (default bf16 on accelerators, fp32 on CPU),
    multiplied as the steps multiply (`layers.project`). The right factor is scaled by 1/sqrt(n) so a
    chain of products keeps its magnitude (no inf or denormal slow paths)."""
    import jax
    import jax.numpy as jnp

    from bastion_jax.modeling.layers import project

    cpu = jax.default_backend() == "cpu"
    n = n or (1024 if cpu else 8192)
    dtype = jnp.dtype(dtype or (jnp.float32 if cpu else jnp.bfloat16))
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)  # [n, n]
    b = (jax.random.normal(kb, (n, n), jnp.float32) / math.sqrt(n)).astype(dtype)
    fn = jax.jit(lambda x, y: project("ij,jk->ik", x, y)).lower(a, b).compile()
    return 2 * n ** 3 / _best_seconds_per_call(fn, a, b, reps=reps, chain=chain)


@dataclasses.dataclass(frozen=True)
class ModelDims:
    layers: int
    hidden: int
    n_q: int
    n_kv: int
    head_dim: int
    ffn: int
    vocab: int
    bytes_per_value: int = 2

    @classmethod
    def of(cls, cfg, bytes_per_value: int) -> "ModelDims":
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                   cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, bytes_per_value)

    def head(self, head_rows: int | None) -> int:
        """LM-head rows a forward scores: `head_rows` (a reduced draft vocabulary), None: the vocabulary."""
        return self.vocab if head_rows is None else head_rows

    def flops(self, s: int, c: int, batch: int = 1, head_rows: int | None = None) -> float:
        """FLOPs of an s-token forward over c cached tokens (projections, attention, MLP, LM head) in
        each of `batch` rows; the LM head scores `self.head(head_rows)` rows."""
        h, hq, hkv = self.hidden, self.n_q * self.head_dim, self.n_kv * self.head_dim
        rows = self.head(head_rows)
        per_layer = 2 * s * h * hq + 4 * s * h * hkv + 4 * s * (c + s) * hq + 2 * s * hq * h + 6 * s * h * self.ffn
        return batch * (self.layers * per_layer + 2 * s * h * rows)

    def weight_values(self, head_rows: int | None = None) -> int:
        """Weight values a forward reads: every layer's matrices and the LM head's `head_rows` rows
        (None: all). The embedding table is not read whole: a step gathers one row per token (counted
        with the activations), and a tied model's table is read once, as its LM head."""
        h, hq, hkv, f = self.hidden, self.n_q * self.head_dim, self.n_kv * self.head_dim, self.ffn
        return self.layers * (2 * h * hq + 2 * h * hkv + 3 * h * f) + h * self.head(head_rows)

    def bytes(self, s: int, c: int, batch: int = 1, head_rows: int | None = None) -> float:
        """Bytes moved: weights (read once for the whole batch), then per row KV read + write,
        activations, the gathered embedding rows and the logits (BASTION's closed form)."""
        h, hq, hkv, f, bp = self.hidden, self.n_q * self.head_dim, self.n_kv * self.head_dim, self.ffn, self.bytes_per_value
        rows = self.head(head_rows)
        kv = self.layers * (2 * c * hkv + 2 * s * hkv)
        act = self.layers * (2 * s * h + 4 * s * hq + 2 * s * hkv + 2 * self.n_q * s * (c + s) + 2 * s * h + 4 * s * f)
        return bp * (self.weight_values(head_rows) + batch * (kv + act + s * h + s * rows))

    def roofline(self, peaks: DevicePeaks, s: int, c: int, batch: int = 1, head_rows: int | None = None) -> float:
        return max(self.flops(s, c, batch, head_rows) / peaks.flops,
                   self.bytes(s, c, batch, head_rows) / peaks.bandwidth)


AR, AR_DRAFT = "ar", "ar+draft"  # the root-step variants, calibrated beside the buckets
_HELD = ":hold"


def held(b: int) -> str:
    """The variant of a tree step of bucket b that does not draft after verifying (bastion's step
    that verifies a held lookup chain), e.g. "8:hold"."""
    return f"{int(b)}{_HELD}"


def held_bucket(variant: int | str) -> int | None:
    """b for `held(b)`, None for any other variant."""
    return int(variant[: -len(_HELD)]) if isinstance(variant, str) and variant.endswith(_HELD) else None


@dataclasses.dataclass
class LatencyModel:
    """T_hat(b, c) for every compiled bucket b; `alpha`/`beta` per bucket, online EMA corrections."""

    target: ModelDims
    peaks: DevicePeaks
    buckets: tuple[int, ...]
    drafter: ModelDims | None = None
    block_size: int = 1
    draft_rows: int | None = None  # LM-head rows a draft scores (a reduced draft vocabulary); None: all
    alpha: dict[int | str, float] = dataclasses.field(default_factory=dict)  # per bucket or root variant
    beta: dict[int | str, float] = dataclasses.field(default_factory=dict)
    ema: dict[int | str, float] = dataclasses.field(default_factory=dict)  # measured / predicted
    ema_rate: float = 0.1
    ema_step: float = 2.0  # one measurement counts as at most this factor off the current prediction
    batch: int = 1  # rows of the steps it prices (a step computes every row of its compiled batch)

    def for_batch(self, batch: int) -> "LatencyModel":
        """This model pricing steps of `batch` rows: the roofline at that batch, the calibration kept
        only when it was measured at that batch (a fit at another batch would misprice the steps)."""
        if batch == self.batch:
            return self
        return dataclasses.replace(self, batch=batch, alpha={}, beta={}, ema={})

    def raw(self, b: int | str, c: int) -> float:
        """Uncalibrated roofline seconds of one step. `b` is a bucket (verify b nodes, then draft one
        block), "ar" (a root step: one target token, no draft), "ar+draft" (a root step that drafts) or
        `held(b)` (verify b nodes, no draft)."""
        verified = held_bucket(b)
        if verified is not None:
            return self.target.roofline(self.peaks, verified, c, self.batch)
        if b in (AR, AR_DRAFT):
            t = self.target.roofline(self.peaks, 1, c, self.batch)
            return t + (self.draft_raw(c) if b == AR_DRAFT else 0.0)
        return self.target.roofline(self.peaks, int(b), c, self.batch) + self.draft_raw(c)

    def draft_raw(self, c: int) -> float:
        """Roofline of the drafter's block forward. It has no embedding or LM head of its own: it scores
        the target's head, on the draft vocabulary's `draft_rows` rows when there is one."""
        if self.drafter is None:
            return 0.0
        return self.drafter.roofline(self.peaks, self.block_size, c, self.batch, self.draft_rows)

    def step_time(self, b: int, c: int, draft: bool) -> float:
        """T(b, c, draft) for the draft gate: b = 0 is a root (AR) step; a tree step that does not draft
        is its own calibrated variant (`held(b)`) when it was profiled, else its drafting step minus the
        measured price of a draft (root step with and without one). The difference alone priced them
        5-12% below their median time in the loop on CPU (SmolLM2, chat prompts: 3-, 7- and 15-node
        chains; its error is the error of three fits), and the gate verified chains that lost time."""
        if b == 0:
            return self.predict(AR_DRAFT if draft else AR, c)
        if not draft and held(b) in self.alpha:
            return self.predict(held(b), c)
        t = self.predict(b, c)
        if draft:
            return t
        return max(t - max(self.predict(AR_DRAFT, c) - self.predict(AR, c), 0.0), 1e-9)

    def variant(self, b: int | str) -> int | str:
        """Which calibrated step prices `b`. With a drafter, bucket 1 (the root alone) is the root step
        that drafts: the same work (one target token, then a block draft) and what bastion runs for it
        (`Engine.tree_step_buckets`), so it shares that step's fit and online correction. Priced apart,
        a machine slower than at calibration left bucket 1 below a plain AR step's price, since only
        the root step's correction followed the machine, and the gate then drafted every step."""
        return AR_DRAFT if b == 1 and self.drafter is not None else b

    def predict(self, b: int | str, c: int) -> float:
        b = self.variant(b)
        fitted = self.alpha.get(b, 1.0) * self.raw(b, c) + self.beta.get(b, 0.0)
        return fitted * self.ema.get(b, 1.0)

    def fit(self, samples: Iterable[tuple[int | str, int, float]]) -> None:
        """Offline calibration: per bucket, least squares of measured seconds on raw roofline. Timings of
        a step that `variant` prices by another (a one-node tree step, which the profiler reports) fit
        nothing."""
        by_bucket: dict[int | str, list[tuple[float, float]]] = {}
        for b, c, t in samples:
            if self.variant(b) == b:
                by_bucket.setdefault(b, []).append((self.raw(b, c), t))
        for b, pts in by_bucket.items():
            xs, ts = [p[0] for p in pts], [p[1] for p in pts]
            mx, mt = sum(xs) / len(xs), sum(ts) / len(ts)
            var = sum((x - mx) ** 2 for x in xs)
            alpha = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var if var > 0 else 0.0
            beta = mt - alpha * mx
            if alpha <= 0 or beta < 0:  # degenerate fit: keep it proportional to the roofline
                alpha, beta = mt / mx, 0.0
            self.alpha[b], self.beta[b] = alpha, beta
            self.ema.pop(b, None)

    def observe(self, b: int | str, c: int, seconds: float) -> None:
        """Online calibration: the correction of bucket b (measured / fitted) follows the measurements
        in log space, each one moving it by at most a factor `ema_step` ** ema_rate. One outlier,
        such as an executable's first run (seen at 9x its steady time on CPU: one-time set-up inside
        XLA), barely moves it; a steady error of any size is still reached, a few steps per doubling.
        A single timing taken as the truth priced a bucket 9x too high, and the gate never drafted
        again to learn otherwise."""
        b = self.variant(b)
        base = self.alpha.get(b, 1.0) * self.raw(b, c) + self.beta.get(b, 0.0)
        if base > 0 and math.isfinite(seconds) and seconds > 0:
            current = self.ema.get(b, 1.0)
            err = math.log(seconds / (base * current))
            limit = math.log(self.ema_step)
            self.ema[b] = current * math.exp(self.ema_rate * min(max(err, -limit), limit))

    # -- persistence -----------------------------------------------------------------------
    # A saved calibration is only valid for the exact setting it was measured in, so the key hashes
    # everything a step's time depends on: the device, the models (their files, not the spelling of
    # their paths: see `model_identity`), the dtype, the compiled buckets, the tree width and the batch. Only a
    # fresh offline fit is ever saved: online EMA corrections describe one run, not the setting.
    def key(self, model: str, dtype: str, tree_top_k: int) -> str:
        ident = json.dumps([STEPS_VERSION, self.peaks.name, device_kind(), model, dtype, list(self.buckets),
                            int(tree_top_k), self.block_size, self.batch, dataclasses.asdict(self.target),
                            self.drafter and dataclasses.asdict(self.drafter), self.draft_rows])
        return hashlib.sha1(ident.encode()).hexdigest()[:16]

    def to_json(self, model: str, dtype: str, tree_top_k: int) -> dict:
        if self.ema:
            raise ValueError("refusing to save a latency model with online (EMA) corrections: only a fresh "
                             "offline calibration is saved")
        return {"steps_version": STEPS_VERSION, "device": self.peaks.name, "device_kind": device_kind(),
                "model": model, "dtype": dtype, "buckets": list(self.buckets), "tree_top_k": int(tree_top_k),
                "batch": self.batch,
                "key": self.key(model, dtype, tree_top_k), "peaks": dataclasses.asdict(self.peaks),
                "calibration": {str(b): {"alpha": self.alpha.get(b, 1.0), "beta": self.beta.get(b, 0.0)}
                                for b in [*self.buckets, *(v for v in self.alpha if isinstance(v, str))]
                                if self.variant(b) == b}}

    def load_json(self, data: dict, model: str, dtype: str, tree_top_k: int) -> bool:
        """Adopt a saved calibration if it was made for this device/models/dtype/buckets/tree width."""
        if data.get("key") != self.key(model, dtype, tree_top_k):
            return False
        peaks = data.get("peaks")
        if isinstance(peaks, dict) and peaks.get("name") == self.peaks.name:
            # alpha/beta were fitted against the roofline made with these peaks (measured ones when
            # the profiler wrote the file), so predictions need the same peaks.
            self.peaks = DevicePeaks(peaks["name"], float(peaks["flops"]), float(peaks["bandwidth"]),
                                     str(peaks.get("source", "datasheet")))
        for b, v in data.get("calibration", {}).items():
            b = int(b) if b.isdigit() else b  # a bucket, or a variant ("ar", "ar+draft", "8:hold")
            self.alpha[b], self.beta[b] = float(v["alpha"]), float(v["beta"])
        self.ema.clear()  # a loaded calibration starts uncorrected, as the fit that wrote it
        return True

    def save(self, path: Path, model: str, dtype: str, tree_top_k: int) -> None:
        """Write the offline fit (atomically: a reader never sees half a file)."""
        data = json.dumps(self.to_json(model, dtype, tree_top_k), indent=2)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(data)
        tmp.replace(path)

    def load(self, path: Path, model: str, dtype: str, tree_top_k: int) -> bool:
        try:
            return self.load_json(json.loads(Path(path).read_text()), model, dtype, tree_top_k)
        except (OSError, ValueError, KeyError, TypeError):
            return False


def model_identity(path: str | Path) -> str:
    """Who a model on disk is, whatever the spelling of its path: the resolved absolute path plus a
    hash of (name, size, mtime) of every file under it. Editing, replacing or re-converting the
    checkpoint changes the identity, so a calibration measured for the old files is not reused."""
    root = Path(path).expanduser().resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    h = hashlib.sha1()
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(root) if f != root else f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"{root}#{h.hexdigest()[:16]}"
