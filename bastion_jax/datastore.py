"""Datastore lookup: a draft chain from text the target itself wrote before (retrieval, as REST).

Why: a small target answers in set phrases ("Here are some tips to ...", a solution's "Step 2:", the
same docstring layout), and its own earlier answers to other prompts are a datastore of them. The
context lookup (`lookup.py`) copies from the current text only and the drafter predicts each block
position on its own (its deep positions guess); a match of the text's last n <= 8 tokens in a few
million tokens of target-written answers proposes a whole coherent continuation. On held-out
prompts of the shipped SmolLM2 pair, the longest match's majority continuation had its first
token right 20% (a 1-2 token match whose continuations disagree) to 81% (8 tokens, a 0.8
majority) of the time.

Search on device, no hashing: every position i of the corpus is sorted by the tokens before it read
backwards (T[i-1], T[i-2], .., T[i-8]; `build_order`, numpy, once per datastore and cached). The
positions that follow an occurrence of the text's last n tokens are then one contiguous range of
that order, found by binary search for every n at once; the longest n with an occurrence wins. Up to
`SAMPLES` of its occurrences, spread evenly over the range, vote token by token: the chain is the
majority continuation (each step keeps the occurrences that agreed), and the first vote's majority
share with the match length picks the chain's class, whose hit rates (`first`, `cont`) were measured
on held-out prompts when the datastore was built and are updated per request like the context
lookup's (`lookup.probabilities`). Verification is unchanged: any chain is lossless.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

MAX_MATCH = 8  # longest suffix matched (tokens)
SAMPLES = 32  # occurrences that vote on the continuation
FANOUT = 15  # pivots per bound and search round
SEP = -1  # between sequences in the corpus; never a token
FILE = "datastore.npz"  # beside a drafter: `generate --datastore auto` uses it
# Chain classes: match length group x the first vote's majority share (the chain's hit rates differ
# most along these two; measured when the datastore is built).
LENGTH_GROUPS = (2, 5, 7)  # n <= 2, 3..5, 6..7, 8
SHARE_BINS = (0.5, 0.8)  # share < 0.5, < 0.8, >= 0.8
NUM_CLASSES = (len(LENGTH_GROUPS) + 1) * (len(SHARE_BINS) + 1)


class DatastoreError(ValueError):
    """A datastore file that cannot be used (missing, corrupt, or for another vocabulary)."""


@struct.dataclass
class Datastore:
    """A corpus of target-written token ids with its suffix order and the chains' prior hit rates."""

    tokens: jax.Array  # [N] int32 sequences back to back between SEPs
    order: jax.Array  # [N] int32 every position, sorted by its preceding tokens read backwards
    first: jax.Array  # [NUM_CLASSES] f32 P(c_1 right) per chain class
    cont: jax.Array  # [NUM_CLASSES] f32 P(c_d right | c_<d right)


def corpus(sequences) -> np.ndarray:
    """[N] int32: the sequences back to back between SEPs (every occurrence of a text, the last
    sequence's end included, has a position after it: a token, or a SEP that votes for nothing)."""
    parts = [np.full(1, SEP, np.int32)]
    for s in sequences:
        parts += [np.asarray(s, np.int32).reshape(-1), np.full(1, SEP, np.int32)]
    return np.concatenate(parts)


def build_order(tokens: np.ndarray) -> np.ndarray:
    """[N] int32 positions sorted by (T[i-1], T[i-2], .., T[i-MAX_MATCH]) (SEP lowest, and before the
    corpus start). Two tokens per uint64 key, so one lexsort of MAX_MATCH / 2 keys."""
    t = np.asarray(tokens, np.int64)
    n = len(t)
    pad = np.concatenate([np.full(MAX_MATCH, SEP, np.int64), t]) + 1  # SEP -> 0, tokens >= 1
    back = [pad[MAX_MATCH - j:MAX_MATCH - j + n].astype(np.uint64) for j in range(1, MAX_MATCH + 1)]  # T[i - j]
    keys = [(back[j] << np.uint64(32)) | back[j + 1] for j in range(0, MAX_MATCH, 2)]
    return np.lexsort(keys[::-1]).astype(np.int32)  # lexsort's primary key is its last


def chain_class(n: jax.Array, share: jax.Array) -> jax.Array:
    """The class of a chain from an n-token match whose first vote had majority `share`."""
    group = jnp.sum(n > jnp.asarray(LENGTH_GROUPS))
    return group * (len(SHARE_BINS) + 1) + jnp.sum(share >= jnp.asarray(SHARE_BINS))


def store_chain(store: Datastore, history: jax.Array, root_pos: jax.Array, depth: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens [depth] (-1: none), class [], found []) of the datastore chain after the root at
    `root_pos` of one row's token `history` [L]. One row; vmap for rows."""
    tokens, order = store.tokens, store.order
    size = tokens.shape[0]
    j = jnp.arange(MAX_MATCH)
    q = jnp.where(root_pos - j >= 0, history[jnp.clip(root_pos - j, 0, history.shape[0] - 1)], SEP)  # [M]
    lens = jnp.arange(1, MAX_MATCH + 1)  # [M] the n of each search

    def compare(s):  # s [2M, F] sorted indices -> sign of key(s)[:n] - q[:n] (n of the search's row)
        pos = order[jnp.clip(s, 0, size - 1)]  # [2M, F]
        idx = pos[..., None] - 1 - j  # [2M, F, M]
        key = jnp.where(idx >= 0, tokens[jnp.maximum(idx, 0)], SEP)
        n = jnp.concatenate([lens, lens])[:, None, None]
        diff = (key != q) & (j < n)
        first = jnp.argmax(diff, axis=-1)  # [2M, F]
        sign = jnp.sign(jnp.take_along_axis(key, first[..., None], -1)[..., 0] - q[first])
        return jnp.where(diff.any(axis=-1), sign, 0)

    # Lower bounds (first key >= q) and upper bounds (first key > q) for every n at once, by a
    # FANOUT-ary search: each round compares FANOUT pivots per bound (XLA:CPU pays ~20 us per loop
    # round, little per compare, so 6 rounds of 15 pivots beat 23 binary ones: 0.45 -> 0.22 ms on the
    # 4.3M-token store shipped then). Pivot arithmetic stays in int32 for corpora below 2^31 / FANOUT.
    upper = jnp.concatenate([jnp.zeros(MAX_MATCH, bool), jnp.ones(MAX_MATCH, bool)])[:, None]
    m = jnp.arange(1, FANOUT + 1)

    def narrow(_, bounds):  # the answer lies in [lo, hi]
        lo, hi = bounds
        pivots = lo[:, None] + (m[None] * (hi - lo)[:, None]) // (FANOUT + 1)  # [2M, F] nondecreasing
        c = compare(pivots)
        below = (c < 0) | (upper & (c == 0))  # pivot before the bound: true for a leading run
        t = jnp.sum(below, axis=1)
        new_lo = jnp.where(t > 0, jnp.take_along_axis(pivots, jnp.maximum(t - 1, 0)[:, None], 1)[:, 0] + 1, lo)
        new_hi = jnp.where(t < FANOUT, jnp.take_along_axis(pivots, jnp.minimum(t, FANOUT - 1)[:, None], 1)[:, 0], hi)
        done = lo >= hi  # (a found bound stays put: at `size`, its pivots would read past the end)
        return jnp.where(done, lo, new_lo), jnp.where(done, hi, new_hi)

    rounds = _rounds(size)
    lo, _ = jax.lax.fori_loop(0, rounds, narrow, (jnp.zeros(2 * MAX_MATCH, jnp.int32),
                                                  jnp.full(2 * MAX_MATCH, size, jnp.int32)))
    start, count = lo[:MAX_MATCH], lo[MAX_MATCH:] - lo[:MAX_MATCH]  # [M] each n's range
    has = (count > 0) & (lens <= root_pos + 1)
    best = jnp.max(jnp.where(has, lens, 0))  # the longest match (0: none)
    i = jnp.maximum(best - 1, 0)
    a, c = start[i], count[i]
    k = jnp.arange(SAMPLES)
    pick = a + jnp.where(c <= SAMPLES, k, (k * c) // SAMPLES)  # evenly over the range
    alive = (k < c) & (best > 0)  # [S]
    pos = order[jnp.clip(pick, 0, size - 1)]  # [S] the corpus position after each occurrence
    cont_idx = pos[:, None] + jnp.arange(depth)[None]  # [S, depth]
    cont = jnp.where(cont_idx < size, tokens[jnp.minimum(cont_idx, size - 1)], SEP)
    chain, shares = [], []
    for d in range(depth):  # majority vote per depth among the occurrences that agreed so far
        tok = cont[:, d]
        voting = alive & (tok != SEP)
        votes = jnp.sum((tok[:, None] == tok[None, :]) & voting[None, :], axis=1)  # [S]
        top = jnp.max(jnp.where(voting, votes, 0))
        winner = jnp.min(jnp.where(voting & (votes == top), tok, jnp.iinfo(jnp.int32).max))  # ties: smallest id
        ok = top > 0
        chain.append(jnp.where(ok, winner, -1))
        shares.append(top / jnp.maximum(jnp.sum(alive), 1))
        alive = alive & ok & (tok == winner)
    chain = jnp.stack(chain).astype(jnp.int32)
    found = chain[0] >= 0
    return chain, chain_class(best, shares[0]), found


def _rounds(size: int) -> int:
    """Search rounds that narrow [0, size] to one index (worst case, with the pivots' rounding)."""
    rounds, s = 0, size
    while s > 0:
        p = [m * s // (FANOUT + 1) for m in range(1, FANOUT + 1)]
        s = max([p[0], s - p[-1] - 1] + [b - a - 1 for a, b in zip(p, p[1:])])
        rounds += 1
    return rounds


# -- files ------------------------------------------------------------------------------------------

def save_datastore(path: str | Path, sequences, first, cont, vocab_size: int, info: dict) -> None:
    """Write `sequences` (token id lists) and the class hit rates as a compressed .npz."""
    tokens = corpus(sequences)
    dtype = np.uint16 if vocab_size < 2 ** 16 - 1 else np.uint32
    stored = np.where(tokens == SEP, np.iinfo(dtype).max, tokens).astype(dtype)
    np.savez_compressed(path, tokens=stored, sep=np.asarray(np.iinfo(dtype).max), first=np.asarray(first, np.float32),
                        cont=np.asarray(cont, np.float32), vocab_size=np.asarray(vocab_size),
                        info=np.asarray(json.dumps(info)))


def _cache_dir() -> Path:
    from bastion_jax.default_model import cache_root

    return cache_root() / "datastore"


def load_datastore(path: str | Path, vocab_size: int | None = None, cache: bool = True) -> Datastore:
    """A datastore file on the device; the suffix order is built once and kept in the cache root
    (keyed by the file's bytes). `vocab_size` checks it was written for this target's vocabulary."""
    path = Path(path)
    try:
        raw = path.read_bytes()  # read once: the cache key and the arrays
        with np.load(io.BytesIO(raw)) as z:
            stored, sep, first, cont = z["tokens"], int(z["sep"]), z["first"], z["cont"]
            file_vocab = int(z["vocab_size"])
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DatastoreError(f"unreadable datastore {path}: {e}") from None
    if first.shape != (NUM_CLASSES,) or cont.shape != (NUM_CLASSES,):
        raise DatastoreError(f"datastore {path}: {first.shape[0]} chain classes, this version reads {NUM_CLASSES}")
    if vocab_size is not None and file_vocab != vocab_size:
        raise DatastoreError(f"datastore {path} was written for a {file_vocab}-token vocabulary; the target has "
                             f"{vocab_size}")
    tokens = np.where(stored == sep, SEP, stored.astype(np.int64)).astype(np.int32)
    order = None
    cached = _cache_dir() / f"{hashlib.sha256(raw).hexdigest()[:24]}.order.npy" if cache else None
    if cached is not None and cached.is_file():
        order = np.load(cached)
        if order.shape != tokens.shape:
            order = None
    if order is None:
        order = build_order(tokens)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp.npy")
            np.save(tmp, order)
            os.replace(tmp, cached)
    return Datastore(jnp.asarray(tokens), jnp.asarray(order), jnp.asarray(first, jnp.float32),
                     jnp.asarray(cont, jnp.float32))


def datastore_info(path: str | Path) -> dict:
    """The provenance a datastore file records (what it holds, how its hit rates were measured)."""
    with np.load(path) as z:
        return json.loads(str(z["info"]))


def resolve_datastore(spec: "Datastore | str | Path | None", target, drafter, lookup) -> Datastore | None:
    """The datastore a user asked for: "auto" (the drafter's `datastore.npz` when it ships one and the
    lookup is on), "off" / None, a file (which needs the lookup), or a loaded `Datastore`."""
    if spec is None or (isinstance(spec, str) and spec in ("off", "none")):
        return None
    vocab = target.config.vocab_size
    if isinstance(spec, str) and spec == "auto":
        path = Path(drafter.path) / FILE if drafter is not None and getattr(drafter, "path", None) else None
        if lookup is None or path is None or not path.is_file():
            return None
        return load_datastore(path, vocab)
    if lookup is None:
        raise DatastoreError("a datastore offers the context lookup a second chain: it needs the lookup on")
    if isinstance(spec, Datastore):
        return spec
    if not Path(spec).is_file():
        raise DatastoreError(f"no datastore file at {spec}")
    return load_datastore(spec, vocab)
