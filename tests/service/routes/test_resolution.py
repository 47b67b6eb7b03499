"""Resolving probes to k distinct items (`resolve_items`, `resolve_in_context`), on real FAISS
indexes."""

from __future__ import annotations

import numpy as np
import pytest

from service.artifacts.bundle import load_bundle
from service.routes.resolution import (
    claim_in_context,
    claim_round_robin,
    first_distinct,
    lead_with_nearest,
    resolve_in_context,
    resolve_items,
)
from service.runtime.encoder import normalize
from service.runtime.filters import where_of
from service.runtime.index import FaissIndex, build_index


def random_index(n: int = 500, d: int = 16, seed: int = 0):
    items = normalize(np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32))
    return build_index(items), items


def test_colliding_probes_resolve_to_distinct_items(small_bundle_dir):
    bundle = load_bundle(small_bundle_dir)
    item = bundle.items.embeddings[3]
    probes = np.tile(item, (10, 1))  # ten identical probes
    selections, grounded = resolve_items(bundle.index, [probes], item[None], [10])
    picked = selections[0]
    assert len(set(picked.rows)) == 10 and picked.filled == 0
    assert picked.rows[0] == 3 and picked.scores[0] > 0.999  # the first claim keeps its top-1
    assert grounded[0] > 0.999


def test_distinct_probes_keep_their_own_nearest_item(small_bundle_dir):
    bundle = load_bundle(small_bundle_dir)
    picks = np.array([1, 50, 100, 150, 200])
    probes = bundle.items.embeddings[picks]
    selections, _ = resolve_items(bundle.index, [probes], probes[:1], [5])
    assert sorted(selections[0].rows) == sorted(picks.tolist())
    assert {row: slot for row, slot in zip(selections[0].rows, selections[0].slots,
                                           strict=True)} == {int(p): i for i, p in enumerate(picks)}


def test_a_collision_gives_the_less_confident_probe_its_next_best_item():
    index, items = random_index()
    probes = np.stack([items[7], normalize(items[7] + 0.2 * items[8])])  # both nearest item 7
    selections, _ = resolve_items(index, [probes], probes[:1], [2])
    assert selections[0].rows[0] == 7 and selections[0].slots == [0, 1]
    assert selections[0].rows[1] != 7


def test_more_items_than_probes_round_robins_without_repeats():
    index, items = random_index()
    selections, grounded = resolve_items(index, [items[:3]], items[:1], [25])
    picked = selections[0]
    assert len(picked.rows) == 25 and len(set(picked.rows)) == 25
    assert set(picked.slots) == {0, 1, 2} and picked.filled == 0
    assert grounded[0] > 0.99  # the probes are items


def test_missing_probes_are_filled_from_the_query_and_counted():
    index, items = random_index()
    selections, grounded = resolve_items(index, [items[:2], items[:0]], items[5:7], [10, 10],
                                         [1, 1])
    with_two, with_none = selections
    assert with_two.slots[:2] == [0, 1] and with_two.filled == 8
    assert with_none.filled == 10 and with_none.rows[0] == 6  # the query itself comes first
    assert grounded[1] == 0.0
    for s in selections:
        assert len(set(s.rows)) == 10


def test_queries_of_one_batch_may_ask_for_different_k():
    index, items = random_index()
    selections, _ = resolve_items(index, [items[:4], items[10:14]], items[[0, 10]], [3, 7])
    assert [len(s.rows) for s in selections] == [3, 7]
    assert set(selections[0].rows) <= set(range(4)) and selections[1].rows[:4] != []


def test_claims_go_to_the_most_confident_probe_first():
    rows = np.array([[5, 6], [5, 7]])
    scores = np.array([[0.5, 0.4], [0.9, 0.1]], dtype=np.float32)
    picked = claim_round_robin(rows, scores, 2)
    assert picked.rows == [5, 6] and picked.slots == [1, 0]


def test_first_distinct_replaces_a_repeated_item_from_later_rows():
    catalog = np.eye(6, dtype=np.float32)
    index = build_index(catalog)
    near = lambda i: 0.9 * catalog[i] + 0.1 * catalog[5]  # noqa: E731 - a row near item i
    rows = np.stack([[near(0), near(1), near(1), near(2), near(3), near(2)],
                     [near(4), near(4), near(4), near(4), near(0), near(0)]])  # (2, 6, 6)
    kept = first_distinct(index, rows, 3)  # (2, 3)
    assert kept[0].tolist() == [0, 1, 3]  # the second "1" gives way to a "2"
    # only two distinct items: the first repeat fills the last slot
    assert kept[1].tolist() == [0, 4, 1]
    # the items as a context: the same choice without a catalog search
    context = np.stack([catalog, catalog])
    assert np.array_equal(first_distinct(index, rows, 3, context), kept)
    # weights that point elsewhere decide instead: rows 1 and 2 now point at items 1 and 4
    weights = np.eye(6, dtype=np.float32)[[[0, 1, 4, 2, 3, 2], [4, 4, 4, 4, 0, 0]]]
    assert first_distinct(index, rows, 3, context, weights)[0].tolist() == [0, 1, 2]


def test_context_resolution_claims_only_context_items_nearest_first():
    index, items = random_index()
    context_rows = np.array([[40, 41, 42, 43, 44, 45]])  # (1, C)
    probes = normalize(items[[41, 7, 44]] + 0.05 * items[[0, 1, 2]])[None]  # (1, 3, d)
    selections, grounded = resolve_in_context(index, probes, context_rows, items[context_rows],
                                              items[:1], [5])
    picked = selections[0]
    assert set(picked.rows) <= set(context_rows[0].tolist()) and len(set(picked.rows)) == 5
    assert {41, 44} <= set(picked.rows[:3])  # probes near context items claim them first
    catalog, _ = resolve_items(index, [probes[0]], items[:1], [5])
    assert 7 in catalog[0].rows  # against the catalog, probe 1 would claim item 7
    nearest = np.max(probes[0] @ items[context_rows[0]].T, axis=1)  # (3,) within the context
    assert grounded[0] == pytest.approx(np.clip(nearest, 0.0, 1.0).mean(), abs=1e-6)


def test_context_resolution_fills_past_the_context_from_the_query():
    index, items = random_index()
    context_rows = np.array([[3, 4, 3, 4]])  # two distinct items, repeated to a fixed size
    selections, _ = resolve_in_context(index, items[[3, 4]][None], context_rows,
                                       items[context_rows], items[9:10], [6])
    picked = selections[0]
    assert sorted(picked.rows[:2]) == [3, 4] and picked.filled == 4
    assert len(set(picked.rows)) == 6 and 9 in picked.rows  # the query's own nearest item


def test_a_filtered_query_resolves_against_the_catalog_under_its_filter():
    _, items = random_index()
    metadata = [{"even": row % 2 == 0} for row in range(len(items))]
    index = FaissIndex(build_index(items), metadata)
    where = where_of({"even": True}, {"even"})
    context_rows = np.array([[1, 3, 5, 7], [1, 3, 5, 7]])  # odd rows only
    probes = np.stack([items[[1, 3]], items[[1, 3]]])  # (2, 2, d)
    selections, _ = resolve_in_context(index, probes, context_rows, items[context_rows],
                                       items[:2], [2, 2], [None, where])
    assert sorted(selections[0].rows) == [1, 3]
    assert len(selections[1].rows) == 2 and all(row % 2 == 0 for row in selections[1].rows)
    _, grounded = resolve_in_context(index, probes, context_rows, items[context_rows], items[:2],
                                     [2, 2], [None, where])
    evens = items[0::2]  # the filtered query's groundedness is against the filtered catalog
    expected = np.clip(np.max(probes[1] @ evens.T, axis=1), 0.0, 1.0).mean()
    assert grounded[1] == pytest.approx(expected, abs=1e-5) and grounded[0] > 0.999


def test_context_resolution_of_a_mixed_batch_gives_each_query_its_own_k():
    _, items = random_index()
    metadata = [{"rare": row < 3} for row in range(len(items))]  # a filter only 3 rows match
    index = FaissIndex(build_index(items), metadata)
    rare = where_of({"rare": True}, {"rare"})
    context_rows = np.tile(np.arange(10, 22), (3, 1))  # (3, 12)
    probes = np.stack([items[10:14], items[14:18], items[18:22]])  # (3, 4, d)
    selections, _ = resolve_in_context(index, probes, context_rows, items[context_rows],
                                       items[30:33], [2, 12, 5], [None, None, rare])
    first, second, filtered = selections
    assert len(first.rows) == 2 and set(first.rows) <= set(range(10, 14))
    assert sorted(second.rows) == list(range(10, 22)) and second.filled == 0
    assert sorted(filtered.rows) == [0, 1, 2]  # fewer than k match: fewer are returned


def test_context_resolution_without_rows_fills_every_slot_from_the_query():
    index, items = random_index()
    context_rows = np.array([[1, 2, 3]])
    selections, grounded = resolve_in_context(index, np.zeros((1, 0, items.shape[1])),
                                              context_rows, items[context_rows], items[5:6], [4])
    assert selections[0].filled == 4 and grounded[0] == 0.0
    assert selections[0].rows[0] == 5  # the query is item 5's vector: its own item first


def test_a_lead_puts_the_querys_own_nearest_first_at_the_same_length():
    index, items = random_index()
    queries = items[[7, 9, 11]]  # each query sits on an item: its nearest is that item
    others = np.random.default_rng(1).choice(np.arange(20, 500), (3, 10), replace=False)
    probes = [items[rows] for rows in others]
    selections, _ = resolve_items(index, probes, queries, [10, 10, 10])
    before = [list(s.rows) for s in selections]
    slots = list(selections[0].slots)
    selections[1].rows[4] = 9  # query 1's own item already among its claims
    before[1][4] = 9
    lead_with_nearest(index, selections, queries, [1, 1, 0])
    own, again, untouched = selections
    assert own.rows == [7, *before[0][:9]] and own.slots[0] is None and own.led == 1
    assert own.filled == 0 and own.slots[1:] == slots[:9]  # the probes' claims keep their slots
    assert again.rows == [9, *(r for r in before[1] if r != 9)]  # not repeated, order kept
    assert untouched.rows == before[2] and untouched.led == 0
    assert all(len(s.rows) == 10 == len(set(s.rows)) for s in selections)


def test_pointer_claims_take_the_item_a_mixture_points_at_where_cosine_would_not():
    index, items = random_index()
    context_rows = np.array([[10, 11, 12, 13]])  # (1, C)
    context = items[context_rows]  # (1, C, d)
    # each row weighs one item most, but the rest pull its mixture nearer another item
    weights = np.array([[[0.40, 0.30, 0.30, 0.00], [0.00, 0.00, 0.45, 0.55]]])  # (1, L, C)
    probes = normalize((weights @ context).astype(np.float32))
    cosine, _ = resolve_in_context(index, probes, context_rows, context, items[:1], [2])
    pointed, _ = resolve_in_context(index, probes, context_rows, context, items[:1], [2],
                                    weights=weights.astype(np.float32))
    assert set(pointed[0].rows) == {10, 13}  # each row's heaviest item
    assert (probes[0] @ context[0].T).argmax(axis=1).tolist() == [1, 3]
    assert set(cosine[0].rows) == {11, 13}  # cosine claims the first row's nearest instead



def test_claims_read_only_as_deep_as_round_robin_can_reach():
    rng = np.random.default_rng(3)
    q, probes, c, d = 5, 10, 40, 8
    rows = np.stack([rng.permutation(1000)[:c] for _ in range(q)])  # (Q, C)
    context = normalize(rng.standard_normal((q, c, d)).astype(np.float32))
    weights = rng.random((q, probes, c)).astype(np.float32)  # (Q, L, C)
    weights[:, :, 7] += 1.0  # every probe's best item is one: many rounds of collisions
    for k in (10, 30):  # depth 16 of 40, then all 40
        claimed, _ = claim_in_context(context[:, :probes], rows, context, [k] * q, weights)
        for i in range(q):
            order = np.argsort(-weights[i], axis=1, kind="stable")  # the whole ranking
            full = claim_round_robin(rows[i][order], np.take_along_axis(weights[i], order, 1), k)
            assert claimed[i].rows == full.rows and claimed[i].slots == full.slots


def test_one_round_claims_equal_the_round_robin_in_a_mixed_batch():
    rng = np.random.default_rng(5)
    q, probes, c, d = 12, 6, 20, 8
    rows = np.stack([rng.permutation(1000)[:c] for _ in range(q)])  # (Q, C)
    rows[3, 4] = -1  # a missing item: the loop's
    rows[5, 9] = rows[5, 2]  # a repeated item: the loop's
    context = normalize(rng.standard_normal((q, c, d)).astype(np.float32))
    weights = rng.random((q, probes, c)).astype(np.float32)  # (Q, L, C)
    weights[:, :, 2] += 1.0  # every probe wants one item: collisions in every query
    ks = [1, 3, 6, 8, 6, 6, 2, 6, 4, 5, 6, 6]  # 8 > L: more than one round
    claimed, _ = claim_in_context(context[:, :probes], rows, context, ks, weights)
    for i in range(q):
        order = np.argsort(-weights[i], axis=1, kind="stable")
        full = claim_round_robin(rows[i][order], np.take_along_axis(weights[i], order, 1), ks[i])
        assert claimed[i].rows == full.rows and claimed[i].slots == full.slots
        assert claimed[i].scores == full.scores
