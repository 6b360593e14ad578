"""Frequency-ranked draft vocabulary (FR-Spec) for training: the ranking file and the reduced LM head.

A drafter only ever needs to predict what the target says, and the target's own text uses a small
part of its vocabulary often. Ranking token ids by how often they occur in target-generated
responses and keeping the top N lets training compute the LM head (the largest single cost of a
small drafter's step) over N rows instead of the whole vocabulary. Labels outside the kept set get
no loss: inference with the same restriction (`--draft-vocab`) can never draft them anyway.

The ranking is stored beside a drafter's `config.json` as `vocab_ranking.npy` (int32, every id of
the vocabulary once, most frequent first, ties by id): the file `speculative.resolve_draft_vocab`
reads at inference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, NamedTuple

import jax.numpy as jnp
import numpy as np

from bastion_jax.speculative import RANKING_FILE


class VocabError(ValueError):
    """A ranking or draft vocabulary that cannot be used (wrong ids, unreadable file, bad size)."""


def rank_vocab(records_or_token_arrays: Iterable, vocab_size: int) -> np.ndarray:
    """All ids [0, vocab_size) as int32, most frequent first, ties (unseen ids included) by id.

    Items are training records (their `response_ids` are counted: the target's own text) or plain
    arrays of token ids."""
    counts = np.zeros(vocab_size, np.int64)
    for item in records_or_token_arrays:
        ids = np.asarray(item["response_ids"] if isinstance(item, dict) else item, np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise VocabError(f"token ids outside the vocabulary [0, {vocab_size}) while ranking")
        counts += np.bincount(ids, minlength=vocab_size)
    # lexsort sorts by the last key first: descending count, then ascending id.
    return np.lexsort((np.arange(vocab_size), -counts)).astype(np.int32)


def check_ranking(ranking: np.ndarray, vocab_size: int | None = None) -> np.ndarray:
    """`ranking` as int32 after checking it is a permutation of [0, V) (V = vocab_size if given)."""
    ranking = np.asarray(ranking)
    n = len(ranking) if vocab_size is None else vocab_size
    if (ranking.ndim != 1 or not np.issubdtype(ranking.dtype, np.integer) or len(ranking) != n
            or not np.array_equal(np.sort(ranking), np.arange(n))):
        raise VocabError(f"a token ranking must list every id of a {n}-token vocabulary exactly once "
                         f"(got {ranking.dtype} {ranking.shape})")
    return ranking.astype(np.int32)


def save_ranking(drafter_dir: str | Path, ranking: np.ndarray) -> Path:
    """Write `vocab_ranking.npy` beside the drafter's config.json; returns its path."""
    path = Path(drafter_dir) / RANKING_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, check_ranking(ranking))
    return path


def load_ranking(drafter_dir: str | Path) -> np.ndarray | None:
    """The ranking stored beside a drafter (int32, most frequent first), or None when it has none."""
    path = Path(drafter_dir) / RANKING_FILE
    if not path.is_file():
        return None
    try:
        ranking = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise VocabError(f"unreadable token ranking {path}: {e}") from None
    return check_ranking(ranking)


class LossVocab(NamedTuple):
    """The output vocabulary of the training loss: the LM-head rows it scores and where labels land.

    head: [N, hidden] rows of the target's LM head (all V rows when the vocabulary is not reduced).
    index: [V] int32, a target id's row in `head`, or -1 for ids outside it; None for the full vocabulary.
    """

    head: jnp.ndarray
    index: jnp.ndarray | None


def lm_head_weight(target) -> jnp.ndarray:
    """The target's LM head [V, hidden] (its embedding when the two are tied)."""
    head = target.state["lm_head"] if "lm_head" in target.state else target.state["embed_tokens"]
    return head["weight"][...]


def loss_vocab(target, ranking: np.ndarray | None, size: int) -> LossVocab:
    """The top `size` ids of `ranking` with their LM-head rows; size 0 (or >= V) keeps the full vocabulary."""
    vocab = target.config.vocab_size
    full = lm_head_weight(target)
    if size < 0:
        raise VocabError(f"--draft-vocab must be >= 0 (0 = the full vocabulary), got {size}")
    if size == 0 or size >= vocab:
        return LossVocab(full, None)
    if ranking is None:
        raise VocabError(f"a draft vocabulary of {size} tokens needs a token ranking")
    ids = check_ranking(ranking, vocab)[:size]
    index = np.full(vocab, -1, np.int32)
    index[ids] = np.arange(size, dtype=np.int32)
    return LossVocab(jnp.take(full, jnp.asarray(ids), axis=0), jnp.asarray(index))
