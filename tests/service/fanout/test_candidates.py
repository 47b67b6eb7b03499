"""Candidate generation by source, on the small real bundle."""

from __future__ import annotations

import numpy as np
import pytest

from service.artifacts.bundle import load_bundle
from service.errors import BundleError
from service.fanout.candidates import candidate_rows, fuse
from service.runtime.encoder import Encoder
from service.runtime.index import search


@pytest.fixture(scope="module")
def bundle(small_bundle_dir):
    return load_bundle(small_bundle_dir)


def test_sources_dense_lexical_and_their_fusion(bundle):
    texts = ["dog", "musical instrument"]
    queries = Encoder(bundle.encoder_config).encode(texts)
    dense = candidate_rows(bundle, texts, queries, 30, "dense")
    lexical = candidate_rows(bundle, texts, queries, 30, "lexical")
    hybrid = candidate_rows(bundle, texts, queries, 30, "hybrid")
    assert np.array_equal(np.stack(dense), search(bundle.index, queries, 30)[1])
    for d, lex, h in zip(dense, lexical, hybrid, strict=True):
        assert len(h) == len(set(h.tolist())) == 30
        assert set(h.tolist()) <= set(d.tolist()) | set(lex.tolist())
        both = [r for r in d.tolist() if r in set(lex.tolist())]
        if both:  # found by both sources: ranked first
            assert h[0] in both


def test_fusion_ranks_by_summed_reciprocal_rank():
    assert fuse([np.array([1, 2, 3]), np.array([3, 4])], 3).tolist() == [3, 1, 2]


def test_lexical_sources_need_the_index_and_sources_are_checked(bundle):
    queries = Encoder(bundle.encoder_config).encode(["dog"])
    with pytest.raises(BundleError, match="unknown candidate source"):
        candidate_rows(bundle, ["dog"], queries, 5, "nearest")
    bare = type(bundle)(bundle.path, bundle.manifest, bundle.items, bundle.index, None)
    with pytest.raises(BundleError, match="lexical index"):
        candidate_rows(bare, ["dog"], queries, 5, "hybrid")
