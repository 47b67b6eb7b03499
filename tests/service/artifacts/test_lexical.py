"""The lexical index: built by the catalog stage into the bundle, checksummed, searched."""

from __future__ import annotations

import shutil

import pytest

from service.artifacts.bundle import load_bundle
from service.artifacts.lexical import (
    LEXICAL_FILE,
    LexicalIndex,
    build_lexical_index,
    frequent_words,
    match_expression,
)
from service.errors import BundleError


def test_the_catalog_stage_builds_a_checksummed_lexical_index(small_bundle_dir):
    bundle = load_bundle(small_bundle_dir)
    assert LEXICAL_FILE in bundle.manifest["files"]
    assert bundle.manifest["stages"]["lexical"]["inputs"].keys() == {"catalog"}
    assert bundle.lexical is not None and bundle.lexical.size == len(bundle.items)
    found, nothing = bundle.lexical.search(["dogs", "zzzqqq"], 20)
    assert len(found) and len(nothing) == 0
    for row in found:  # Porter stemming: "dogs" matches "dog"
        assert "dog" in bundle.items.texts[row].lower()


def test_a_corrupted_lexical_index_is_refused(small_bundle_dir, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(small_bundle_dir, copy)
    with (copy / LEXICAL_FILE).open("r+b") as handle:
        handle.seek(-16, 2)
        handle.write(b"\xff" * 16)
    with pytest.raises(BundleError, match=r"lexical\.sqlite fails its sha256"):
        load_bundle(copy)


@pytest.mark.parametrize("query, expression", [
    ("Musical instrument", '"musical" OR "instrument"'),
    ('a "b" OR c*', '"a" OR "b" OR "or" OR "c"'),  # no FTS5 syntax gets through
    ("--- !!", None),
])
def test_queries_become_quoted_word_alternatives(query, expression):
    assert match_expression(query) == expression


def test_words_in_most_texts_are_not_searched(tmp_path):
    texts = [f"item {i}: a thing of the sort" for i in range(40)] + ["lamp: a lamp of brass"]
    assert {"a", "of", "the", "thing", "sort", "item"} <= set(frequent_words(texts))
    assert "lamp" not in frequent_words(texts)
    build_lexical_index(tmp_path / "x.sqlite", texts)
    index = LexicalIndex(tmp_path / "x.sqlite")
    lamp, sort = index.search(["lamp of the sort", "sort"], 50)
    assert lamp.tolist() == [40]  # "of", "the", "sort" dropped: only the lamp matches
    assert len(sort) == 40  # a query of frequent words only searches them all
    assert match_expression("lamp of brass", {"of"}) == '"lamp" OR "brass"'
    assert match_expression("of the", {"of", "the"}) == '"of" OR "the"'
