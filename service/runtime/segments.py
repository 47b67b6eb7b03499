"""Per-query work on a batch flattened into one array, each entry tagged with its query (its
owner): one numpy call for the whole batch instead of a few per query."""

from __future__ import annotations

from itertools import pairwise

import numpy as np


def spans(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, position within its owner) of each entry (Σ sizes,), for owners holding
    sizes (Q,) consecutive entries each."""
    owners = np.repeat(np.arange(len(sizes)), sizes)  # (M,)
    starts = np.cumsum(sizes) - sizes  # (Q,)
    return owners, np.arange(len(owners)) - starts[owners]  # (M,), (M,)


def sum_by_owner(owners: np.ndarray, rows: np.ndarray, weights: np.ndarray,
                 width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each distinct (owner, row) of entries (M,), rows in [0, width): its owner, row,
    first entry and summed weight (U,) each, sorted by owner, then row. np.bincount adds the
    weights in entry order, as a running sum would, so a per-query sum gives the same floats."""
    unique, first, inverse = np.unique(owners * width + rows, return_index=True,
                                       return_inverse=True)
    sums = np.bincount(inverse, weights=weights, minlength=len(unique))  # (U,)
    return unique // width, unique % width, first, sums


def first_n_each(owners: np.ndarray, values: np.ndarray, count: int, n: int) -> list[np.ndarray]:
    """values (M,) grouped by owners (M,), ascending, ranked within each owner → each of the
    `count` owners' first n (empty for an owner without entries)."""
    bounds = np.searchsorted(owners, np.arange(count + 1))  # (count + 1,)
    return [values[a : min(b, a + n)] for a, b in pairwise(bounds.tolist())]


def best_each(sizes: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """(Q,) the entry of each owner (sizes (Q,), each ≥ 1) with the highest score (M,), the
    first of them on a tie; a NaN score ranks last."""
    owners, _ = spans(sizes)
    order = np.lexsort((np.arange(len(scores)), -scores, owners))  # (M,) by owner, best first
    return order[np.cumsum(sizes) - sizes]  # (Q,) each owner's first


def first_occurrences(ids: np.ndarray) -> np.ndarray:
    """(Q, M) bool: True where an entry of ids (Q, M) is the first of its value in its row."""
    order = np.argsort(ids, axis=1, kind="stable")  # (Q, M): equal values keep their order
    ranked = np.take_along_axis(ids, order, axis=1)  # (Q, M)
    repeat = np.zeros(ids.shape, dtype=bool)  # (Q, M), in ranked order
    repeat[:, 1:] = ranked[:, 1:] == ranked[:, :-1]
    first = np.empty_like(repeat)  # (Q, M), in the given order
    np.put_along_axis(first, order, ~repeat, axis=1)
    return first
