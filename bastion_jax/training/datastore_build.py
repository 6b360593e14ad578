"""Building a datastore (`bastion_jax.datastore`) from target-written training data, with its chains'
hit rates measured on held-out prompts.

The rates must come from prompts the datastore does not hold: the training sets repeat prompts
across files (another seed or temperature of the same gsm8k_train question, Magpie prompts the
target wrote twice), and a chain copied from the same prompt's other answer is right far more often
than it will be on a new prompt. So `held_out` greedy rows are drawn, every row that shares a
prompt with one of them leaves the measuring datastore, and the chain after each of their first
`positions` response tokens is judged against what the target wrote next (`lookup.chain_outcome`,
the rule decoding learns by). The shipped file then holds every distinct row.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bastion_jax.datastore import (NUM_CLASSES, Datastore, build_order, corpus, save_datastore, store_chain)
from bastion_jax.lookup import chain_outcome
from bastion_jax.training.data import check_vocab

DEPTH = 15  # chain length measured (a 16-slot block's drafts)


def _store(sequences) -> Datastore:
    tokens = corpus(sequences)
    return Datastore(jnp.asarray(tokens), jnp.asarray(build_order(tokens)), jnp.zeros(NUM_CLASSES, jnp.float32),
                     jnp.zeros(NUM_CLASSES, jnp.float32))


def measure_rates(store: Datastore, rows: Sequence[tuple[list[int], int]], positions: int, batch: int = 256
                  ) -> np.ndarray:
    """[NUM_CLASSES, 4] first hits, first trials, cont hits, cont trials of the chains after each of
    the first `positions` response tokens of `rows` ((sequence, prompt length) pairs)."""
    width = max(len(s) for s, _ in rows)
    queries = [(s, r) for s, p in rows for r in range(p, min(len(s) - 1, p + positions))]

    @jax.jit
    def judge(history, root, future, known):  # [n, width], [n], [n, DEPTH], [n]
        chain, cls, found = jax.vmap(store_chain, in_axes=(None, 0, 0, None))(store, history, root, DEPTH)
        outcome = jax.vmap(chain_outcome)(chain, future, known)  # [n, 4]
        return jax.ops.segment_sum(jnp.where(found[:, None], outcome, 0.0), cls, NUM_CLASSES)

    counts = np.zeros((NUM_CLASSES, 4))
    for i in range(0, len(queries), batch):
        part = queries[i:i + batch] + [queries[0]] * (batch - len(queries[i:i + batch]))  # one shape
        real = min(batch, len(queries) - i)
        history = np.zeros((batch, width), np.int32)
        future = np.full((batch, DEPTH), -1, np.int32)
        root, known = np.zeros(batch, np.int32), np.zeros(batch, np.int32)
        for k, (s, r) in enumerate(part):
            history[k, :r + 1] = s[:r + 1]
            nxt = s[r + 1:r + 1 + DEPTH]
            future[k, :len(nxt)] = nxt
            root[k], known[k] = r, len(nxt) if k < real else 0
        counts += np.asarray(judge(history, root, future, known))
    return counts


def rates(counts: np.ndarray, prior_weight: float = 20.0) -> tuple[np.ndarray, np.ndarray]:
    """(first, cont) per class: hits over trials, shrunk towards the pooled rate of all classes by
    `prior_weight` trials (a class seen a few times gets about the pooled rate)."""
    pooled_first = counts[:, 0].sum() / max(counts[:, 1].sum(), 1)
    pooled_cont = counts[:, 2].sum() / max(counts[:, 3].sum(), 1)
    first = (counts[:, 0] + prior_weight * pooled_first) / (counts[:, 1] + prior_weight)
    cont = (counts[:, 2] + prior_weight * pooled_cont) / (counts[:, 3] + prior_weight)
    return np.clip(first, 0.01, 0.95), np.clip(cont, 0.01, 0.95)


def _greedy(record: dict) -> bool:
    return float(record.get("temperature", 0.0)) == 0.0


def _distinct(records: Sequence[dict]) -> tuple[list[dict], int]:
    """The records with exact repeats (prompt and response) folded into their first place, and how
    many were folded; a greedy copy's record replaces a sampled one."""
    first: dict[tuple, int] = {}
    kept: list[dict] = []
    for r in records:
        key = (tuple(r["prompt_ids"]), tuple(r["response_ids"]))
        if key not in first:
            first[key] = len(kept)
            kept.append(r)
        elif _greedy(r) and not _greedy(kept[first[key]]):
            kept[first[key]] = r
    return kept, len(records) - len(kept)


def build_datastore(records: Sequence[dict], out: str | Path, vocab_size: int, *, files: Sequence[str] = (),
                    held_out: int = 400, positions: int = 96, seed: int = 0, log=print) -> dict:
    """Write `out` (every distinct record, prompt + response) with hit rates measured on `held_out`
    greedy rows against a datastore without their prompts. Returns the provenance it records.

    Exact repeats (same prompt and response, e.g. from data sets made with overlapping seeds) are
    stored once: a chain is the majority vote of the matches, and a row stored k times would cast k
    votes. A repeat keeps the greedy label if any copy has it, so it can still measure the rates."""
    records, repeats = _distinct(records)
    if repeats:
        log(f"{repeats} records repeat another exactly and are stored once")
    seqs = [(list(r["prompt_ids"]) + list(r["response_ids"]), len(r["prompt_ids"])) for r in records]
    check_vocab([s for s, _ in seqs], vocab_size)
    greedy = [i for i, r in enumerate(records) if _greedy(r) and r["response_ids"]]
    if not greedy:
        raise ValueError("the datastore's hit rates are measured on greedy rows (temperature 0): the data has none")
    rng = np.random.default_rng(seed)
    dev = sorted(rng.choice(greedy, min(held_out, len(greedy)), replace=False).tolist())
    dev_prompts = {tuple(records[i]["prompt_ids"]) for i in dev}
    measuring = [s for (s, _), r in zip(seqs, records) if tuple(r["prompt_ids"]) not in dev_prompts]
    if not measuring:
        raise ValueError("every row shares a prompt with a held-out row: no datastore is left to measure on")
    log(f"measuring hit rates: {len(dev)} held-out greedy rows against {len(measuring)} rows of other prompts")
    counts = measure_rates(_store(measuring), [seqs[i] for i in dev], positions)
    first, cont = rates(counts)
    info = {"rows": len(seqs), "repeats_dropped": repeats, "tokens": int(sum(len(s) for s, _ in seqs)),
            "files": list(files),
            "held_out_rows": len(dev), "positions_per_row": positions, "seed": seed,
            "counts": counts.astype(int).tolist(), "first": first.round(4).tolist(), "cont": cont.round(4).tolist(),
            "date": datetime.date.today().isoformat(),
            "how": "python -m bastion_jax.train_drafter datastore (bastion_jax/training/datastore_build.py)"}
    save_datastore(out, [s for s, _ in seqs], first, cont, vocab_size, info)
    return info


def build_from_files(paths: Sequence[str | Path], out: str | Path, vocab_size: int | None = None, *,
                     held_out: int = 400, seed: int = 0, log=print) -> dict:
    """`build_datastore` over data files (JSONL or packed .npz, `training.data.read_records`); the
    vocabulary defaults to the one the packed files name."""
    from bastion_jax.training.data import read_records

    records = [r for p in paths for r in read_records(p)]
    if vocab_size is None:
        sizes = {int(np.load(p)["vocab_size"]) for p in paths if str(p).endswith(".npz")}
        if len(sizes) != 1:
            raise ValueError("--vocab-size is needed (the data files do not name one vocabulary)")
        vocab_size = sizes.pop()
    info = build_datastore(records, out, vocab_size, files=[str(p) for p in paths], held_out=held_out, seed=seed,
                           log=log)
    log(f"wrote {out}: {info['rows']} rows, {info['tokens']} tokens ({Path(out).stat().st_size / 1e6:.1f} MB); "
        f"first-token hit rate per class {info['first']}")
    return info
