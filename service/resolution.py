"""Resolving probe embeddings (sub-queries or generated rows) to k distinct catalog items."""

from __future__ import annotations

import faiss
import numpy as np

from service.index import search

DEPTH = 16  # neighbours fetched per probe; collisions beyond this are rare and retried deeper


def distinct_nearest(
    index: faiss.Index, probes: np.ndarray, depth: int = DEPTH
) -> tuple[np.ndarray, np.ndarray]:
    """Nearest item per probe with no item used twice within a query.

    probes: (Q, k, d). Slots claim items in order of their best score, so the most confident
    slot keeps its top-1 and a colliding slot takes its next-best neighbour. Returns
    (rows, scores), each (Q, k); scores are the cosine of each probe to its item.
    """
    q, k, d = probes.shape
    depth = min(max(depth, k), index.ntotal)
    scores, rows = search(index, probes.reshape(q * k, d), depth)
    scores = scores.reshape(q, k, depth)  # (Q, k, depth)
    rows = rows.reshape(q, k, depth)  # (Q, k, depth)
    out_rows = np.empty((q, k), dtype=np.int64)
    out_scores = np.empty((q, k), dtype=np.float32)
    last_resort = depth >= min(index.ntotal, 4096)  # repeat an item rather than search forever
    for i in range(q):
        resolved = _claim(rows[i], scores[i], last_resort)
        if resolved is None:  # every neighbour of some slot was taken: search deeper
            deeper_rows, deeper_scores = distinct_nearest(index, probes[i : i + 1], depth * 4)
            out_rows[i], out_scores[i] = deeper_rows[0], deeper_scores[0]
        else:
            out_rows[i], out_scores[i] = resolved
    return out_rows, out_scores


def _claim(
    rows: np.ndarray, scores: np.ndarray, allow_repeat: bool
) -> tuple[np.ndarray, np.ndarray] | None:
    """Greedy claim for one query: rows/scores (k, depth) sorted best first per slot."""
    k, depth = rows.shape
    taken: set[int] = set()
    out_rows = np.empty(k, dtype=np.int64)
    out_scores = np.empty(k, dtype=np.float32)
    for slot in np.argsort(-scores[:, 0], kind="stable"):
        for j in range(depth):
            row = int(rows[slot, j])
            if row >= 0 and row not in taken:
                taken.add(row)
                out_rows[slot], out_scores[slot] = row, scores[slot, j]
                break
        else:
            if allow_repeat:
                out_rows[slot], out_scores[slot] = rows[slot, 0], scores[slot, 0]
                continue
            return None
    return out_rows, out_scores
