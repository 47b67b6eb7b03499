"""Per-query work on a batch flattened into one array, each entry tagged with its query (its
owner): one numpy call for the whole batch instead of a few per query."""

from __future__ import annotations

from itertools import pairwise

import numpy as np


def sum_by_owner(owners: np.ndarray, rows: np.ndarray, weights: np.ndarray,
                 width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each distinct (owner, row) of entries (M,), rows < width: its owner, row, first
    entry and summed weight, sorted by owner, then row. np.bincount adds the weights in entry
    order, as a running sum would, so a per-query sum gives the same floats."""
    unique, first, inverse = np.unique(owners * width + rows, return_index=True,
                                       return_inverse=True)
    sums = np.bincount(inverse, weights=weights, minlength=len(unique))  # (U,)
    return unique // width, unique % width, first, sums


def first_n_each(owners: np.ndarray, values: np.ndarray, count: int, n: int) -> list[np.ndarray]:
    """values (M,) grouped by owners (M,), ascending, ranked within each owner → each of the
    `count` owners' first n (empty for an owner without entries)."""
    bounds = np.searchsorted(owners, np.arange(count + 1))  # (count + 1,)
    return [values[a : min(b, a + n)] for a, b in pairwise(bounds.tolist())]
