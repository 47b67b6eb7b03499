import numpy as np
import pytest

from service.artifacts.parts import PARTS_FILE, ItemParts, context_features
from service.errors import BundleError
from service.runtime.encoder import normalize


def test_similarities_are_each_query_s_cosine_to_each_part_of_its_rows():
    rng = np.random.default_rng(0)
    vectors = normalize(rng.normal(size=(6, 3, 8))).astype(np.float16)
    parts = ItemParts(("a", "b", "c"), vectors)
    queries = normalize(rng.normal(size=(2, 8))).astype(np.float32)
    rows = np.array([[0, 5], [3, 3]])
    got = parts.similarities(rows, queries)
    assert got.shape == (2, 2, 3) and got.dtype == np.float32
    for b in range(2):
        for c in range(2):
            expected = vectors[rows[b, c]].astype(np.float32) @ queries[b]
            np.testing.assert_allclose(got[b, c], expected, rtol=1e-5, atol=1e-6)


def test_context_features_are_embeddings_then_cosines():
    rng = np.random.default_rng(1)
    embeddings = normalize(rng.normal(size=(6, 8))).astype(np.float32)
    parts = ItemParts(("a", "b"), normalize(rng.normal(size=(6, 2, 8))).astype(np.float16))
    rows, queries = np.array([[1, 2, 4]]), normalize(rng.normal(size=(1, 8))).astype(np.float32)
    features = context_features(embeddings[rows], parts, rows, queries)
    assert features.shape == (1, 3, 10)
    np.testing.assert_array_equal(features[0, :, :8], embeddings[[1, 2, 4]])
    np.testing.assert_allclose(features[..., 8:], parts.similarities(rows, queries))
    np.testing.assert_array_equal(context_features(embeddings[rows], None, rows, queries),
                                  embeddings[rows])


def test_a_parts_file_of_another_shape_is_refused(tmp_path):
    np.save(tmp_path / PARTS_FILE, np.zeros((5, 2, 4), dtype=np.float16))
    assert ItemParts.load(tmp_path, ("a", "b"), 5).vectors.shape == (5, 2, 4)
    with pytest.raises(BundleError, match="not"):
        ItemParts.load(tmp_path, ("a", "b", "c"), 5)
    with pytest.raises(BundleError, match="catalog"):
        ItemParts.load(tmp_path / "none", ("a",), 5)
