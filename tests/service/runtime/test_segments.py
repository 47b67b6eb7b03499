"""Per-query work on a flattened batch, against the per-query loop it stands for."""

from __future__ import annotations

import numpy as np

from service.runtime.segments import (
    best_each,
    first_n_each,
    first_occurrences,
    spans,
    sum_by_owner,
)


def test_spans_number_each_owners_entries() -> None:
    owners, positions = spans(np.array([2, 0, 3]))
    assert owners.tolist() == [0, 0, 2, 2, 2] and positions.tolist() == [0, 1, 0, 1, 2]


def test_sums_by_owner_are_a_running_sums_per_query() -> None:
    rng = np.random.default_rng(0)
    owners = np.sort(rng.integers(0, 6, 300))
    rows, weights = rng.integers(0, 20, 300), rng.random(300)
    owner, row, first, sums = sum_by_owner(owners, rows, weights, 20)
    expected: dict[tuple[int, int], float] = {}
    seen: dict[tuple[int, int], int] = {}
    for i, key in enumerate(zip(owners.tolist(), rows.tolist(), strict=True)):
        expected[key] = expected.get(key, 0.0) + float(weights[i])
        seen.setdefault(key, i)
    keys = list(zip(owner.tolist(), row.tolist(), strict=True))
    assert keys == sorted(expected)
    assert sums.tolist() == [expected[k] for k in keys]  # the same floats, not close ones
    assert first.tolist() == [seen[k] for k in keys]


def test_first_n_of_each_owner_and_none_for_an_owner_without_entries() -> None:
    values = np.array([7, 8, 9, 4, 5])
    got = first_n_each(np.array([0, 0, 0, 2, 2]), values, 4, 2)
    assert [g.tolist() for g in got] == [[7, 8], [], [4, 5], []]


def test_best_of_each_owner_first_on_a_tie_and_nan_last() -> None:
    scores = np.array([0.1, 0.9, 0.9, np.nan, 0.2, 0.5, 0.3, 0.3])
    assert best_each(np.array([3, 3, 2]), scores).tolist() == [1, 5, 6]


def test_first_occurrences_mark_each_value_once_per_row() -> None:
    ids = np.array([[3, 1, 3, -1, 1, 2], [5, 5, 5, 0, -1, -1]])
    assert first_occurrences(ids).astype(int).tolist() == [[1, 1, 0, 1, 0, 1],
                                                            [1, 0, 0, 1, 1, 0]]
