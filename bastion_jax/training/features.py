"""Target tap features of a training set, computed once per sequence and kept for later epochs.

The frozen target's forward is the costliest part of a drafter step when it runs every step (a
30-layer target under a 2-layer drafter), yet its output depends only on the sequence. A
`FeatureStore` computes a batch's features on first use, writes them to a memory-mapped file under
the run directory and serves them from there afterwards, so from the second epoch on a step never
runs the target. The file is keyed by a fingerprint of the data, the taps and the target; a resumed
run picks up where the previous one stopped (the per-row `done` flags are saved with checkpoints).

Each store also records a content hash per row (`<name>-<key>.rows.npy`: the row's tokens, taps and
target). A new store first copies every row it can find, by hash, in the other stores of its own
directory and of `reuse` directories (an earlier run's `features/`): growing the data set or starting
a new run on the same target then costs the target forward of the new rows only, not of all of them.

Features are stored as bfloat16 (half of float32's disk and memory): SmolLM2's residual stream has
massive activations (|x| up to ~25,000 at layer 14), too close to float16's 65,504 limit to risk.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Sequence

import jax
import ml_dtypes
import numpy as np

STORE_DTYPE = ml_dtypes.bfloat16


def fingerprint(tokens: np.ndarray, **keys) -> str:
    """A short hash of a token matrix and whatever else decides its features (taps, target, ...)."""
    h = hashlib.sha1(np.ascontiguousarray(tokens).tobytes())
    h.update(json.dumps(dict(keys, shape=list(tokens.shape)), sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def row_hashes(tokens: np.ndarray, **keys) -> np.ndarray:
    """[n] uint64 content hash of each row of `tokens` [n, S] together with `keys` (taps, target, ...)."""
    salt = json.dumps(keys, sort_keys=True, default=str).encode()
    rows = np.ascontiguousarray(tokens)
    return np.array([int.from_bytes(hashlib.sha1(salt + row.tobytes()).digest()[:8], "little") for row in rows],
                    np.uint64)


def target_fingerprint(target) -> dict:
    """What identifies a target's features: its config, path, dtype and a checksum of some weights."""
    emb = np.asarray(jax.device_get(target.state["embed_tokens"]["weight"][...][:64]), np.float64)
    return {"config": target.config.to_hf(), "path": str(target.path), "dtype": str(target.dtype),
            "checksum": float(np.round(emb.sum(), 6))}


class FeatureStore:
    """Features [n, S, F] of the rows of `tokens` [n, S]; `compute(tokens [b, S]) -> [b, S, F]`.

    With `directory` None nothing is kept: every `get` computes (a one-epoch run, or data too big to store).
    """

    def __init__(self, tokens: np.ndarray, feature_dim: int, compute: Callable[[np.ndarray], jax.Array],
                 directory: str | Path | None, name: str, keys: dict, reuse: Sequence[str | Path] = ()):
        self.tokens, self.compute = tokens, compute
        self.directory = None if directory is None else Path(directory)
        self.data = self.done = None
        self.reused = 0  # rows copied from other stores when this one was created
        if self.directory is None:
            return
        key = fingerprint(tokens, **keys)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"{name}-{key}.bin"
        self.done_path = self.directory / f"{name}-{key}.done.npy"
        self.rows_path = self.directory / f"{name}-{key}.rows.npy"
        shape = (len(tokens), tokens.shape[1], feature_dim)
        resume = self.path.is_file() and self.done_path.is_file()
        self.data = np.memmap(self.path, dtype=STORE_DTYPE, mode="r+" if resume else "w+", shape=shape)
        self.done = np.load(self.done_path) if resume else np.zeros(len(tokens), bool)
        if not resume:
            hashes = row_hashes(tokens, **keys)
            np.save(self.rows_path, hashes)
            self.reused = self._copy_from([self.directory, *map(Path, reuse)], hashes)
            self.flush()
        for stale in self.directory.glob(f"{name}-*"):  # an older data set or target: never read again
            if not stale.name.startswith(f"{name}-{key}."):
                stale.unlink()

    def _copy_from(self, directories: list[Path], hashes: np.ndarray) -> int:
        """Copy rows whose hash matches a done row of another store (same row length and width)."""
        where = {int(h): i for i, h in enumerate(hashes)}
        row_shape = self.data.shape[1:]
        row_bytes = int(np.prod(row_shape)) * np.dtype(STORE_DTYPE).itemsize
        for rows_file in sorted(p for d in directories for p in d.glob("*.rows.npy")):
            if rows_file == self.rows_path:
                continue
            stem = rows_file.name[: -len(".rows.npy")]
            done_file, bin_file = rows_file.with_name(stem + ".done.npy"), rows_file.with_name(stem + ".bin")
            if not (done_file.is_file() and bin_file.is_file()):
                continue
            other_hashes, other_done = np.load(rows_file), np.load(done_file)
            if bin_file.stat().st_size != len(other_hashes) * row_bytes:
                continue  # another row length or feature width
            other = np.memmap(bin_file, dtype=STORE_DTYPE, mode="r", shape=(len(other_hashes), *row_shape))
            for j, h in enumerate(other_hashes):
                i = where.get(int(h))
                if i is not None and other_done[j] and not self.done[i]:
                    self.data[i] = other[j]
                    self.done[i] = True
        return int(self.done.sum())

    @property
    def cached(self) -> int:
        """Rows whose features are stored."""
        return 0 if self.done is None else int(self.done.sum())

    def get(self, idx: np.ndarray) -> jax.Array | np.ndarray:
        """Features of rows `idx` [b]: stored bfloat16 rows when cached (computing any missing ones first),
        else freshly computed ones in the compute dtype."""
        if self.data is None:
            return self.compute(self.tokens[idx])
        missing = ~self.done[idx]
        if missing.any():
            fresh = np.asarray(jax.device_get(self.compute(self.tokens[idx])))  # [b, S, F]
            rows = idx[missing]
            self.data[rows] = fresh[missing].astype(STORE_DTYPE)
            self.done[rows] = True
        return self.data[idx]

    def flush(self) -> None:
        """Make the stored rows durable (data first, then the flags that vouch for it)."""
        if self.data is not None:
            self.data.flush()
            np.save(self.done_path, self.done)
