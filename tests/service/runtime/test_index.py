import numpy as np
import pytest

from service.fanout.candidates import Candidates
from service.runtime.index import build_index, neighbour_rows, neighbourhood


def _unit(rows: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_neighbour_rows_are_the_nearest_items_best_first():
    catalog, queries = _unit(50), _unit(3, seed=1)
    rows = neighbour_rows(build_index(catalog), queries, 5)
    assert np.array_equal(rows, np.argsort(-(queries @ catalog.T), axis=1)[:, :5])
    context = neighbourhood(build_index(catalog), catalog, queries, 5)
    assert context.shape == (3, 5, 16) and np.array_equal(context, catalog[rows])


def test_a_catalog_smaller_than_the_context_repeats_its_rows():
    catalog = _unit(3)
    rows = neighbour_rows(build_index(catalog), catalog[:2], 7)
    assert rows.shape == (2, 7)
    for row in rows:
        assert set(row.tolist()) == {0, 1, 2} and np.array_equal(row[3:6], row[:3])


class _Partial:
    """An index that, like an approximate one, finds fewer than asked (-1 elsewhere)."""

    ntotal = 10
    backend = "partial"

    def __init__(self, found: list[list[int]]) -> None:
        self.found = np.array(found, dtype=np.int64)

    def search(self, queries: np.ndarray, k: int, where=None) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(self.found.shape, np.float32), self.found


def test_missing_neighbours_repeat_the_found_ones_in_order():
    rows = neighbour_rows(_Partial([[4, 2, -1, -1], [7, -1, -1, -1]]), _unit(2), 4)
    assert rows.tolist() == [[4, 2, 4, 2], [7, 7, 7, 7]]
    with pytest.raises(ValueError, match="no neighbours"):
        neighbour_rows(_Partial([[-1, -1]]), _unit(1), 2)
    assert neighbour_rows(_Partial([[1]]), np.zeros((0, 16), np.float32), 3).shape == (0, 3)


def test_the_diffusion_context_follows_the_source_its_sampler_records(small_bundle_dir):
    from service.artifacts.bundle import load_bundle
    from service.errors import BundleError
    from service.fanout.format import item_name
    from service.fanout.grounding import PromptNeighbourhood
    from service.routes.diffusion import DiffusionContext
    from service.runtime.encoder import Encoder

    bundle = load_bundle(small_bundle_dir)
    texts = ["dog", "tool"]
    queries = Encoder(bundle.encoder_config).encode(texts)  # (2, d)
    assert DiffusionContext(bundle, {"context": 0})(texts, queries) is None
    nearest = DiffusionContext(bundle, {"context": 4})(texts, queries)  # (2, 4, d)
    assert np.array_equal(nearest, neighbourhood(bundle.index, bundle.items.embeddings,
                                                 queries, 4))
    named = DiffusionContext(bundle, {"context": 4, "context_source": "prompt"})(texts, queries)
    rows = PromptNeighbourhood(Candidates(bundle.index), bundle.items.texts,
                               bundle.items.embeddings, 4).rows(texts, queries)
    assert np.array_equal(named, bundle.items.embeddings[rows])
    top = neighbour_rows(bundle.index, queries[:1], 1)[0, 0]  # the "dog" vector's nearest item
    own = item_name(bundle.items.texts[top])
    skipped = DiffusionContext(bundle, {"context": 4, "context_source": "prompt"})([own],
                                                                                  queries[:1])
    assert np.array_equal(nearest[0, 0], bundle.items.embeddings[top])
    # a prompt skips the item named like its query
    assert not (skipped[0] == bundle.items.embeddings[top]).all(axis=1).any()
    with pytest.raises(BundleError, match="context source"):
        DiffusionContext(bundle, {"context": 4, "context_source": "random"})


def test_an_index_chosen_at_load_searches_the_bundles_rows(small_bundle_dir):
    from service.artifacts.bundle import load_bundle
    from service.runtime.index import IndexChoice, search

    exact = load_bundle(small_bundle_dir)
    chosen = load_bundle(small_bundle_dir, IndexChoice.parse("HNSW16/efSearch=256"))
    assert type(exact.index.faiss).__name__ == "IndexFlatIP"
    assert type(chosen.index.faiss).__name__ == "IndexHNSWFlat"
    assert chosen.index.faiss.hnsw.efSearch == 256
    queries = exact.items.embeddings[::50]  # (Q, d)
    _, want = search(exact.index, queries, 10)
    _, got = search(chosen.index, queries, 10)
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(want, got, strict=True)])
    assert overlap > 0.95  # approximate, but on the same rows: row i is item ids[i]


@pytest.mark.parametrize("name, problem", [("Nonsense12", "could not parse"),
                                           ("HNSW16/bogus=3", "could not set parameter bogus")])
def test_a_bad_index_choice_is_refused_with_faisss_reason(small_bundle_dir, name, problem):
    from service.artifacts.bundle import load_bundle
    from service.errors import BundleError
    from service.runtime.index import IndexChoice

    with pytest.raises(BundleError, match=problem):
        load_bundle(small_bundle_dir, IndexChoice.parse(name))


def test_index_choices_round_trip_their_names():
    from service.runtime.index import IndexChoice

    for name in ("bundle", "HNSW32", "HNSW32/efSearch=128", "IVF64,Flat/nprobe=8"):
        assert IndexChoice.parse(name).name == name
    assert IndexChoice.parse("bundle") == IndexChoice()
