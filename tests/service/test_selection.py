"""Round-robin claiming of k distinct items from probes, on a real FAISS index."""

from __future__ import annotations

import numpy as np

from service.encoder import normalize
from service.index import build_index
from service.resolution import distinct_nearest
from service.selection import claim_round_robin, select_items


def random_index(n: int = 500, d: int = 16, seed: int = 0):
    items = normalize(np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32))
    return build_index(items), items


def test_k_equal_to_probes_matches_distinct_nearest():
    index, items = random_index()
    rng = np.random.default_rng(1)
    probes = normalize(items[rng.choice(500, 10)] + 0.3 * rng.standard_normal((10, 16)))
    probes[3] = probes[7]  # a collision: the two probes must get different items
    selections, _ = select_items(index, [probes], probes[:1], 10)
    rows, _ = distinct_nearest(index, probes[None])
    assert sorted(selections[0].rows) == sorted(rows[0].tolist())
    assert len(set(selections[0].rows)) == 10


def test_more_items_than_probes_round_robins_without_repeats():
    index, items = random_index()
    probes = items[:3]
    selections, grounded = select_items(index, [probes], items[:1], 25)
    picked = selections[0]
    assert len(picked.rows) == 25 and len(set(picked.rows)) == 25
    assert set(picked.slots) == {0, 1, 2} and picked.filled == 0
    assert grounded[0] > 0.99  # the probes are items


def test_missing_probes_are_filled_from_the_query_and_counted():
    index, items = random_index()
    selections, grounded = select_items(index, [items[:2], items[:0]], items[5:7], 10, [1, 1])
    with_two, with_none = selections
    assert with_two.slots[:2] == [0, 1] and with_two.filled == 8
    assert with_none.filled == 10 and with_none.rows[0] == 6  # the query itself comes first
    assert grounded[1] == 0.0
    for s in selections:
        assert len(set(s.rows)) == 10


def test_claims_go_to_the_most_confident_probe_first():
    rows = np.array([[5, 6], [5, 7]])
    scores = np.array([[0.5, 0.4], [0.9, 0.1]], dtype=np.float32)
    picked = claim_round_robin(rows, scores, 2)
    assert picked.rows == [5, 6] and picked.slots == [1, 0]
