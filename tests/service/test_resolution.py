import numpy as np

from service.bundle import load_bundle
from service.resolution import distinct_nearest


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
