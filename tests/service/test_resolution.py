import numpy as np

from service.bundle import load_bundle
from service.resolution import distinct_nearest, first_distinct_rows


def test_colliding_probes_resolve_to_distinct_items(small_bundle_dir):
    bundle = load_bundle(small_bundle_dir)
    item = bundle.items.embeddings[3]
    probes = np.tile(item, (1, 10, 1))  # ten identical probes
    rows, scores = distinct_nearest(bundle.index, probes)
    assert len(set(rows[0].tolist())) == 10
    assert 3 in rows[0]
    assert scores[0].max() > 0.999
    assert np.all(scores[0] <= scores[0].max())


def test_distinct_probes_keep_their_own_nearest_item(small_bundle_dir):
    bundle = load_bundle(small_bundle_dir)
    picks = np.array([1, 50, 100, 150, 200])
    rows, _ = distinct_nearest(bundle.index, bundle.items.embeddings[picks][None])
    assert rows[0].tolist() == picks.tolist()


def test_first_distinct_rows_replace_a_repeated_item_from_later_rows():
    from service.index import build_index

    catalog = np.eye(6, dtype=np.float32)
    index = build_index(catalog)
    near = lambda i: 0.9 * catalog[i] + 0.1 * catalog[5]  # noqa: E731 - a row near item i
    rows = np.stack([[near(0), near(1), near(1), near(2), near(3), near(2)],
                     [near(4), near(4), near(4), near(4), near(0), near(0)]])  # (2, 6, 6)
    kept = first_distinct_rows(index, rows, 3)  # (2, 3, 6)
    assert np.array_equal(kept[0], rows[0, [0, 1, 3]])  # the second "1" gives way to a "2"
    # only two distinct items: the first repeat fills the last slot
    assert np.array_equal(kept[1], rows[1, [0, 4, 1]])
    # the items as a context: the same choice without a catalog search
    assert np.array_equal(first_distinct_rows(index, rows, 3, np.stack([catalog, catalog])), kept)
