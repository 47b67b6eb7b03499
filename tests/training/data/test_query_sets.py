"""The narrow and mixed query sets, derived from WordNet over whatever catalog a bundle holds."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from service.errors import InputError
from training.data.query_sets import (
    MIXED_NARROW_SHARE,
    NARROW_MAX_DESCENDANTS,
    catalog_ids,
    load_queries,
)
from training.data.splits import load_split
from training.data.wordnet import descendants


def test_a_narrow_query_names_one_item_whose_kin_is_its_reference(
        small_bundle_dir, wordnet_synsets):
    senses = Counter(lemma.lower() for s in wordnet_synsets.values() for lemma in s.lemmas)
    ids = catalog_ids(small_bundle_dir)
    queries = load_queries(small_bundle_dir, "narrow-val")
    assert len(queries) >= 50
    for query in queries:
        synset = wordnet_synsets[query.target]
        kin = descendants(wordnet_synsets, query.target)
        assert query.query == synset.lemmas[0] and senses[query.query.lower()] == 1
        assert len(kin) <= NARROW_MAX_DESCENDANTS and query.query[0].islower()
        assert query.groups[0] == [query.target]
        assert query.reference == {query.target} | kin and query.reference <= ids


def test_splits_are_disjoint_deterministic_and_mixed_in_proportion(small_bundle_dir):
    val, test = (load_queries(small_bundle_dir, f"narrow-{s}") for s in ("val", "test"))
    assert not {q.target for q in val} & {q.target for q in test}
    assert [q.target for q in load_queries(small_bundle_dir, "narrow-val")] == \
        [q.target for q in val]
    mixed = load_queries(small_bundle_dir, "mixed-test")
    broad = load_split(small_bundle_dir, "test")
    narrow = [q for q in mixed if q.target is not None]
    assert {q.query for q in broad} <= {q.query for q in mixed}
    assert len(narrow) == round(len(broad) * MIXED_NARROW_SHARE / (1 - MIXED_NARROW_SHARE))
    assert {q.target for q in narrow} <= {q.target for q in test}


def test_a_catalog_without_wordnet_ids_has_no_narrow_set(small_bundle_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "items.jsonl").write_text(json.dumps({"id": "sku-1", "text": "tent"}) + "\n")
    with pytest.raises(InputError, match="derived from WordNet"):
        load_queries(other, "narrow-test")
    with pytest.raises(InputError, match="split must be one of"):
        load_queries(small_bundle_dir, "narrow-train")
