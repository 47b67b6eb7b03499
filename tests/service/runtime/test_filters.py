"""Metadata filters: the canonical form, its checks, and rows matched as the engines match."""

from __future__ import annotations

import pytest

from service.errors import InputError
from service.runtime.filters import RowFilter, expression, where_of

METADATA = [{"shelf": "a", "flag": True, "n": 1}, {"shelf": "b", "flag": False, "n": 1.0},
            {"shelf": "a", "flag": 1, "n": 2}, {"shelf": "a"}]


def test_true_and_one_are_different_filters_as_in_the_engines():
    fields = {"flag"}
    assert where_of({"flag": True}, fields) != where_of({"flag": 1}, fields)
    rows = RowFilter(METADATA)
    assert rows.rows(where_of({"flag": True}, fields)).tolist() == [0]
    assert rows.rows(where_of({"flag": 1}, fields)).tolist() == [2]
    assert rows.rows(where_of({"n": 1}, {"n"})).tolist() == [0, 1]  # 1 == 1.0, as in Milvus


def test_every_pair_is_required_and_the_expression_quotes_strings():
    where = where_of({"shelf": "a", "n": 2}, {"shelf", "n"})
    assert RowFilter(METADATA).rows(where).tolist() == [2]
    assert expression(where) == 'n == 2 and shelf == "a"'
    assert expression(where_of({"shelf": 'say "hi"'}, {"shelf"})) == 'shelf == "say \\"hi\\""'
    assert expression(where_of({"shelf": "😀"}, {"shelf"})) == 'shelf == "😀"'  # no \\u escape
    assert where_of({}, {"shelf"}) is None and where_of(None, {"shelf"}) is None


@pytest.mark.parametrize("mapping, problem", [
    ({"colour": "red"}, "not in the catalog's metadata"),
    ({"bad name": 1}, "not a field name"),
    ({"n": float("nan")}, "finite"),
    ({"n": float("inf")}, "finite"),
    ({"n": 2**64}, "64 bits"),
    ({"n": [1]}, "string, number or boolean"),
    ({"shelf": "a\nb"}, "control character"),
    ({"shelf": "lone \ud83d"}, "control character"),  # a surrogate no engine can encode
])
def test_a_bad_filter_is_an_input_error_naming_it(mapping, problem):
    with pytest.raises(InputError, match=problem):
        where_of(mapping, {"n", "shelf"})


@pytest.mark.parametrize("factory", ["Flat", "HNSW16", "PCA16,Flat"])
def test_a_filtered_faiss_search_returns_the_best_matching_rows_on_any_index_type(factory):
    import numpy as np

    from service.runtime.index import FaissIndex, build_index

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((400, 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    metadata = [{"shelf": "a" if i % 7 == 0 else "b"} for i in range(len(vectors))]
    index = FaissIndex(build_index(vectors, factory), metadata, factory, vectors)
    queries = vectors[:5]
    _, rows = index.search(queries, 10, where_of({"shelf": "a"}, {"shelf"}))
    allowed = np.arange(0, len(vectors), 7)
    exact = allowed[np.argsort(-(queries @ vectors[allowed].T), axis=1)[:, :10]]
    assert all(r % 7 == 0 for r in rows.ravel())
    if factory != "HNSW16":  # the graph walk may miss one: only membership is exact
        assert np.array_equal(rows, exact)
