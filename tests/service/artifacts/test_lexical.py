"""The lexical index: built by the catalog stage into the bundle, checksummed, searched."""

from __future__ import annotations

import shutil
import sqlite3

import pytest

from service.artifacts import lexical as lexical_module
from service.artifacts.bundle import load_bundle
from service.artifacts.lexical import (
    LEXICAL_FILE,
    MAX_QUERY_WORDS,
    LexicalIndex,
    build_lexical_index,
    frequent_words,
    query_words,
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


def test_the_ranking_is_fts5s_own(small_bundle_dir):
    """bm25s over FTS5's postings returns FTS5's `ORDER BY rank` list, ties by row."""
    bundle = load_bundle(small_bundle_dir)
    assert bundle.lexical is not None
    db = sqlite3.connect(small_bundle_dir / LEXICAL_FILE)
    queries = [t.split(":")[0] for t in bundle.items.texts[::7]] + ["musical instruments"]
    for query, rows in zip(queries, bundle.lexical.search(queries, 30), strict=True):
        expression = " OR ".join(f'"{w}"' for w in query_words(query, bundle.lexical.frequent))
        expected = [r for (r,) in db.execute("SELECT rowid FROM items WHERE items MATCH ? "
                                             "ORDER BY rank, rowid LIMIT 30", (expression,))]
        assert rows.tolist() == expected, query
    assert sum(len(rows) > 1 for rows in bundle.lexical.search(queries, 30)) > len(queries) / 2


def test_the_ranking_is_fts5s_own_for_common_tokens_and_joined_words(tmp_path):
    """A token in most texts keeps FTS5's idf floor (texts rank by tf and length, not by row);
    "rock_roll" is two words to both, as unicode61 splits at "_"."""
    texts = [("thing " * (1 + i % 4) + f"word{i} " + "x " * (i % 7)).strip() for i in range(40)]
    texts += ["rock_roll band", "rock and roll", "lamp of things"]
    build_lexical_index(tmp_path / "x.sqlite", texts)
    index = LexicalIndex(tmp_path / "x.sqlite")
    db = sqlite3.connect(tmp_path / "x.sqlite")
    for query in ("thing", "things", "rock_roll", "lamp things x"):
        expression = " OR ".join(f'"{w}"' for w in query_words(query, index.frequent))
        expected = [r for (r,) in db.execute("SELECT rowid FROM items WHERE items MATCH ? "
                                             "ORDER BY rank, rowid LIMIT 15", (expression,))]
        assert index.search([query], 15)[0].tolist() == expected, query
    assert index.search(["thing"], 15)[0].tolist() != list(range(15))  # not in row order


@pytest.mark.parametrize("query, kept", [
    ("Musical instrument", ["musical", "instrument"]),
    ('a "b" OR c*', ["a", "b", "or", "c"]),  # no FTS5 syntax gets through
    ("--- !!", []),
])
def test_queries_become_their_words(query, kept):
    assert query_words(query) == kept


def test_words_in_most_texts_are_not_searched(tmp_path):
    texts = [f"item {i}: a thing of the sort" for i in range(40)] + ["lamp: a lamp of brass"]
    assert {"a", "of", "the", "thing", "sort", "item"} <= set(frequent_words(texts))
    assert "lamp" not in frequent_words(texts)
    build_lexical_index(tmp_path / "x.sqlite", texts)
    index = LexicalIndex(tmp_path / "x.sqlite")
    lamp, sort = index.search(["lamp of the sort", "sort"], 50)
    assert lamp.tolist() == [40]  # "of", "the", "sort" dropped: only the lamp matches
    assert len(sort) == 40  # a query of frequent words only searches them all
    assert query_words("lamp of brass", {"of"}) == ["lamp", "brass"]
    assert query_words("of the", {"of", "the"}) == ["of", "the"]


def test_a_long_query_of_never_seen_words_costs_one_tokenizing_statement(small_bundle_dir):
    """A query's words are capped and tokenized together: 200 never-seen words cost one
    SELECT and MAX_QUERY_WORDS inserts, not three statements a word; a repeat costs none."""
    index = LexicalIndex(small_bundle_dir / LEXICAL_FILE)
    statements: list[str] = []
    index.tokenizer._db.set_trace_callback(statements.append)
    query = " ".join(f"zq{i}xv" for i in range(200))
    assert index.token_ids(query) == [] and index.breadth(query) == 0
    assert sum(s.startswith("SELECT") for s in statements) == 1
    assert sum(s.startswith("INSERT") for s in statements) == MAX_QUERY_WORDS
    statements.clear()
    index.search([query], 10)
    assert statements == []
    index.close()


def test_a_query_s_ids_are_worked_out_once_and_handed_out_as_copies(small_bundle_dir,
                                                                     monkeypatch):
    index = LexicalIndex(small_bundle_dir / LEXICAL_FILE)
    first = index.token_ids("dogs and trees")
    assert first  # words the catalog uses
    calls = []
    monkeypatch.setattr(index.tokenizer, "tokens_of", lambda words: calls.append(words))
    first.append(-1)  # a caller's copy: the next caller gets the ids unchanged
    assert index.token_ids("dogs and trees") == first[:-1] and calls == []
    index.close()


def test_a_query_of_common_words_reads_a_bounded_share_of_the_postings(tmp_path, monkeypatch):
    """The commonest of a query's tokens are dropped once their postings pass the budget: the
    rare word still ranks, and a token in every text is not summed over the catalog."""
    texts = [f"thing stuff word{i}" if i < 20 else f"thing word{i}" for i in range(40)]
    build_lexical_index(tmp_path / "x.sqlite", texts)
    index = LexicalIndex(tmp_path / "x.sqlite")
    assert len(index.search(["thing stuff"], 40)[0]) == 40  # within the budget: both searched
    monkeypatch.setattr(lexical_module, "POSTINGS_BUDGET", 30)
    assert index.search(["thing stuff"], 40)[0].tolist() == list(range(20))  # "stuff"'s only
    assert len(index.search(["thing"], 40)[0]) == 40  # the rarest token is always kept
