"""EAGLE-3 draft vocabulary: the N most frequent tokens of the training data.

    d2t  i64[N]  offsets: target_id = draft_id + d2t[draft_id]
    t2d  bool[V] which target tokens are in the draft vocabulary
    hot  i32[N]  target id of each draft id (= arange(N) + d2t), ascending

Draft ids are assigned in ascending target-id order, so ``d2t`` is non-negative.
"""

from __future__ import annotations

import numpy as np


def token_counts(stream: np.ndarray, vocab_size: int) -> np.ndarray:  # i64[V]
    stream = np.asarray(stream).reshape(-1)
    if stream.size and (stream.min() < 0 or stream.max() >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size})")
    return np.bincount(stream, minlength=vocab_size).astype(np.int64)


def build_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d2t i64[N], t2d bool[V], hot i32[N]) for the ``draft_vocab_size`` most frequent tokens
    (ties go to the lower id)."""
    V = len(counts)
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in [1, {V}], got {draft_vocab_size}")
    order = np.lexsort((np.arange(V), -np.asarray(counts)))  # by count desc, then id asc
    hot = np.sort(order[:draft_vocab_size]).astype(np.int64)
    t2d = np.zeros(V, bool)
    t2d[hot] = True
    d2t = hot - np.arange(draft_vocab_size, dtype=np.int64)
    return d2t, t2d, hot.astype(np.int32)
