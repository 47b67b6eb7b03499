"""Resolving probe embeddings (sub-queries or generated rows) to k distinct catalog items."""

from __future__ import annotations

import faiss
import numpy as np

from service.index import search
from service.selection import claim_round_robin

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
    """One query's slots claim one item each (rows/scores (k, depth), best first per slot):
    the first round of `service.selection.claim_round_robin`, laid out by slot."""
    k = rows.shape[0]
    picked = claim_round_robin(rows, scores, k, max_rounds=1)
    out_rows, out_scores = rows[:, 0].copy(), scores[:, 0].copy()  # repeats, if allowed
    if len(picked.rows) < k and not allow_repeat:
        return None
    for row, score, slot in zip(picked.rows, picked.scores, picked.slots, strict=True):
        out_rows[slot], out_scores[slot] = row, score
    return out_rows, out_scores.astype(np.float32)


def first_distinct_rows(index: faiss.Index, rows: np.ndarray, keep: int,
                        context: np.ndarray | None = None) -> np.ndarray:
    """(Q, R, d) rows in priority order → (Q, keep, d): per query, the rows whose items are the
    first `keep` distinct ones; a row whose item an earlier row already has gives way to later
    rows, and fills in, in order, only when too few distinct items are found.

    A row's item is its nearest of the query's context items (B, C, d) when given — the
    student picks among them, and 20 dot products per row cost nothing — else its nearest
    catalog item (one exact search per row: more than the solver itself costs).
    With several draws of the sampler concatenated draw after draw, a row of the first draw
    that collides is replaced by the next draws' rows (the teacher never repeats an item).
    """
    q, r, d = rows.shape
    if context is not None:
        top = np.argmax(rows @ context.transpose(0, 2, 1), axis=2)  # (Q, R) context position
    else:
        _, found = search(index, rows.reshape(q * r, d), 1)  # (Q·R, 1)
        top = found.reshape(q, r)  # (Q, R): each row's nearest catalog item
    out = np.empty((q, keep, d), dtype=rows.dtype)
    for i in range(q):
        seen: set[int] = set()
        first: list[int] = []
        later: list[int] = []
        for j, item in enumerate(top[i].tolist()):
            (first if item not in seen and len(first) < keep else later).append(j)
            seen.add(item)
        out[i] = rows[i, (first + later)[:keep]]  # (keep, d)
    return out
