"""Turning a query's probes (generated rows or sub-query embeddings) into k distinct items.

Round-robin claiming generalises `service.resolution.distinct_nearest` to any k: in each
round the probes, most confident first, claim their best neighbour not yet taken (so with
k = number of probes it is exactly distinct_nearest's greedy claim); later rounds give each
probe its next-best neighbour until k items are claimed. Slots still empty after that are
filled from the query's own dense neighbours and reported as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import faiss
import numpy as np

from service.index import search

MIN_DEPTH = 16  # neighbours fetched per probe


@dataclass
class Selection:
    """k distinct catalog rows for one query, best-claimed first by slot order."""

    rows: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    slots: list[int | None] = field(default_factory=list)  # probe index; None = dense fill

    @property
    def filled(self) -> int:
        return sum(slot is None for slot in self.slots)


def probe_depth(n_probes: int, k: int, n_items: int) -> int:
    """Neighbours per probe so that k claims rarely run out: rounds needed plus slack."""
    rounds = -(-k // max(n_probes, 1))
    return min(n_items, max(MIN_DEPTH, k + rounds))


def claim_round_robin(
    rows: np.ndarray, scores: np.ndarray, k: int, max_rounds: int | None = None
) -> Selection:
    """rows, scores: (P, depth) neighbours of each probe, best first (-1 = none).

    max_rounds caps the items one probe may claim (None = as many as k needs).
    """
    picked = Selection()
    n_probes, depth = rows.shape
    if n_probes == 0:
        return picked
    order = np.argsort(-scores[:, 0], kind="stable")  # most confident probe first
    cursor = np.zeros(n_probes, dtype=np.int64)
    taken: set[int] = set()
    rounds = 0
    while len(picked.rows) < k and (max_rounds is None or rounds < max_rounds):
        rounds += 1
        progressed = False
        for probe in order:
            if len(picked.rows) >= k:
                break
            j = int(cursor[probe])
            while j < depth and (rows[probe, j] < 0 or int(rows[probe, j]) in taken):
                j += 1
            if j < depth:
                row = int(rows[probe, j])
                taken.add(row)
                picked.rows.append(row)
                picked.scores.append(float(scores[probe, j]))
                picked.slots.append(int(probe))
                progressed = True
            cursor[probe] = j + 1
        if not progressed:
            break
    return picked


def fill_from_dense(
    picked: Selection, dense_rows: np.ndarray, dense_scores: np.ndarray, k: int
) -> Selection:
    """Complete `picked` to k items with the query's own neighbours (rows (D,), best first)."""
    taken = set(picked.rows)
    for row, score in zip(dense_rows.tolist(), dense_scores.tolist(), strict=True):
        if len(picked.rows) >= k:
            break
        if row >= 0 and row not in taken:
            taken.add(row)
            picked.rows.append(int(row))
            picked.scores.append(float(score))
            picked.slots.append(None)
    return picked


def select_items(
    index: faiss.Index,
    probes: list[np.ndarray],
    queries: np.ndarray,
    k: int,
    max_rounds: list[int | None] | None = None,
) -> tuple[list[Selection], np.ndarray]:
    """For each query: probes[i] (P_i, d) → k distinct items; queries (Q, d) fills gaps.

    max_rounds[i] caps the claims per probe of query i (e.g. 1: one item per sub-query,
    every other slot from the query's dense neighbours).
    Returns the selections and each query's groundedness: the mean over its probes of
    max(0, cos(probe, nearest item)) (0 when it has no probe).
    """
    counts = [len(p) for p in probes]
    depth = probe_depth(min([c for c in counts if c] or [1]), k, index.ntotal)
    stacked = np.concatenate([p for p in probes if len(p)] or [np.zeros((0, queries.shape[1]))])
    if len(stacked):
        scores, rows = search(index, stacked.astype(np.float32), depth)  # (ΣP, depth)
    else:
        scores = np.zeros((0, depth), dtype=np.float32)
        rows = np.zeros((0, depth), dtype=np.int64)
    selections: list[Selection] = []
    grounded = np.zeros(len(probes), dtype=np.float32)
    start = 0
    for i, count in enumerate(counts):
        block_rows, block_scores = rows[start : start + count], scores[start : start + count]
        start += count
        cap = max_rounds[i] if max_rounds is not None else None
        selections.append(claim_round_robin(block_rows, block_scores, k, cap))
        if count:
            grounded[i] = float(np.clip(block_scores[:, 0], 0.0, 1.0).mean())
    short = [i for i, s in enumerate(selections) if len(s.rows) < k]
    if short:
        dense_scores, dense_rows = search(index, queries[short], min(index.ntotal, 2 * k + depth))
        for j, i in enumerate(short):
            fill_from_dense(selections[i], dense_rows[j], dense_scores[j], k)
    return selections, grounded
