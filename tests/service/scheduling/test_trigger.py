"""The fan-out trigger: a query's breadth read from the catalog's lexical index, and the
decision route=auto takes from it."""

from __future__ import annotations

import itertools
import math
import sqlite3

import pytest

from service.artifacts.lexical import LEXICAL_FILE, LexicalIndex, query_words
from service.scheduling.trigger import FanoutTrigger


@pytest.fixture(scope="module")
def lexical(small_bundle_dir) -> LexicalIndex:
    index = LexicalIndex(small_bundle_dir / LEXICAL_FILE)
    yield index
    index.close()


def fts5_count(path, words: list[str]) -> int:
    """FTS5's own count of the texts holding every word (its tokenizer stems each the same)."""
    match = " AND ".join('"' + w.replace('"', '""') + '"' for w in words)
    with sqlite3.connect(path) as db:
        return db.execute("SELECT count(*) FROM items WHERE items MATCH ?", (match,)).fetchone()[0]


def probe_queries(benchmark_queries) -> list[str]:
    """Broad benchmark queries, two-word phrases from them, and words no text holds."""
    texts = [q.query for q in benchmark_queries]
    return [*texts, *(f"{a} {b}" for a, b in itertools.pairwise(texts)),
            "small tree", "Plants", "zzyzx", "zzyzx tree"]


def test_breadth_is_the_number_of_texts_holding_every_query_word(
        lexical, small_bundle_dir, benchmark_queries):
    """Words no text holds are left out, as the lexical search leaves them out."""
    path, counts = small_bundle_dir / LEXICAL_FILE, {}
    for query in probe_queries(benchmark_queries):
        known = [w for w in query_words(query, lexical.frequent) if fts5_count(path, [w])]
        counts[query] = lexical.breadth(query)
        assert counts[query] == (fts5_count(path, known) if known else 0), query
    assert counts["zzyzx"] == 0 and counts["zzyzx tree"] == lexical.breadth("tree") > 0
    assert counts["Plants"] == lexical.breadth("plant") > 0  # stemmed and case-folded
    assert len(set(counts.values())) > 5  # the probes span many breadths


def test_auto_fans_out_from_the_threshold_up(lexical, benchmark_queries):
    queries = probe_queries(benchmark_queries)
    scores = [math.log1p(lexical.breadth(q)) for q in queries]
    threshold = sorted(scores)[len(scores) // 2]
    trigger = FanoutTrigger(lexical, threshold)
    for query, score in zip(queries, scores, strict=True):
        decision = trigger.decide(query)
        assert decision.fanout == (score >= threshold)
        assert decision.reason == ("broad" if decision.fanout else "narrow")
        assert decision.score == pytest.approx(score, abs=1e-6)
        assert decision.threshold == threshold
    assert {trigger.decide(q).fanout for q in queries} == {True, False}


def test_the_request_and_a_missing_index_decide_without_a_score(lexical):
    trigger = FanoutTrigger(lexical, 1e9)
    assert trigger.decide("tree", "always").fanout
    assert trigger.decide("tree", "always").reason == "always"
    never = trigger.decide("tree", "never")
    assert not never.fanout and never.reason == "never" and never.score is None
    blind = FanoutTrigger(None, 0.0).decide("tree")
    assert blind.fanout and blind.reason == "no-lexical-index" and blind.score is None
