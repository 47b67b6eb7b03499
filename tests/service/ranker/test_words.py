"""The mention features read from ItemWords in numpy equal the per-row Python definition they
replaced (kept here as the oracle), on every val and test query of the test bundle and on hostile
texts; so do the ranker's top 12."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.artifacts.bundle import load_bundle
from service.artifacts.lexical import MAX_QUERY_WORDS
from service.fanout.format import item_name
from service.ranker.mentions import (
    ABSENT_RANK,
    EARLY,
    END,
    FEATURES,
    NO_MENTION,
    START,
    MentionFeatures,
    MentionWords,
    index_tokens,
)
from service.ranker.ranker import ScoredCandidates
from service.ranker.words import ItemWords, Ragged
from service.runtime.encoder import Encoder
from training.data.splits import query_texts

HOSTILE = ["dog " * 40, "Dogs!", "", "zzqx unknownword", "a of the", "the dog and the cat",
           "tree tree tree", "état café"]


@pytest.fixture(scope="module")
def bundle(small_bundle_dir):
    return load_bundle(small_bundle_dir)


def mention_position(described, searched):
    return next((i for i, t in enumerate(described) if t in searched), None)


def neighbours(described, asked, position):
    if position is None:
        return NO_MENTION, NO_MENTION
    after = position + len(asked)
    return (described[position - 1] if position else START,
            described[after] if after < len(described) else END)


def reference_row(features: MentionFeatures, text: str, row: int, rank: int, mentions: bool,
                  similarity: float, listed: bool) -> list[float]:
    """One candidate's feature row as the service computed it before ItemWords."""
    lexical, item = features.lexical, features.texts[row]
    asked = index_tokens(lexical, text, MAX_QUERY_WORDS)
    searched = frozenset(asked)
    _, colon, gloss = item.partition(":")
    name = index_tokens(lexical, item_name(item))
    described = index_tokens(lexical, gloss if colon else item)
    position = mention_position(described, searched)
    return [similarity, rank if listed else ABSENT_RANK, float(mentions),
            ABSENT_RANK if position is None else position,
            float(position is not None and position < EARLY),
            math.log1p(lexical.breadth(item_name(item))), len(name),
            float(bool(searched & set(name))),
            float(bool(name) and bool(asked) and name[-1] == asked[-1]),
            len(index_tokens(lexical, item)),
            *features.words.ids(*neighbours(described, asked, position))]


def test_ragged_rows_gather_end_to_end_with_their_owner_and_position():
    ragged = Ragged.of([[5, 6], [], [7, 8, 9]])
    values, owner, at = ragged.gather(np.array([2, 1, 0]))
    assert values.tolist() == [7, 8, 9, 5, 6]
    assert owner.tolist() == [0, 0, 0, 2, 2]
    assert at.tolist() == [0, 1, 2, 0, 1]


def test_the_words_either_side_of_a_mention_span_the_query():
    described = ("a", "hunt", "dog", "of", "britain")
    assert neighbours(described, ["dog"], 2) == ("hunt", "of")
    assert neighbours(described, ["a"], 0) == (START, "hunt")
    assert neighbours(described, ["dog", "of", "britain"], 2) == ("hunt", END)
    assert neighbours(described, ["cat"], None) == (NO_MENTION, NO_MENTION)
    words = MentionWords(before=("hunt", NO_MENTION), after=("of",))
    assert words.ids("hunt", "of") == (0.0, 0.0)
    assert words.ids(NO_MENTION, "britain") == (1.0, 1.0)  # an unknown word: one past the end
    assert words.ids("the", NO_MENTION) == (2.0, 1.0)


def test_numpy_features_equal_the_per_row_definition_on_every_held_out_query(
        bundle, small_bundle_dir):
    texts = [*query_texts(small_bundle_dir, "val"), *query_texts(small_bundle_dir, "test"),
             *HOSTILE]
    queries = Encoder(bundle.encoder_config).encode(texts)  # (Q, d)
    scored = ScoredCandidates(bundle)
    features = scored.features
    assert features.words.before, "the test bundle's ranker learned its mention words"
    checked = []
    for text, query, (rows, listed) in zip(texts, queries, features.candidates(texts, queries),
                                          strict=True):
        table = features.features(text, query, rows, listed)
        mentioned = np.isin(rows, features.mentions(text))
        similarity = bundle.items.embeddings[rows] @ query
        expected = np.array([reference_row(features, text, r, j, bool(mentioned[j]),
                                           float(similarity[j]), j < listed)
                             for j, r in enumerate(rows.tolist())], dtype=np.float32)
        np.testing.assert_array_equal(table, expected.reshape(table.shape), err_msg=text)
        checked.append(expected)
    seen = np.concatenate(checked)  # every branch met: mentions, none, words known and not
    position = seen[:, FEATURES.index("mention_position")]
    assert (position == ABSENT_RANK).any() and (position < EARLY).any()
    assert len(np.unique(seen[:, FEATURES.index("word_after_mention")])) > 2
    best = scored.best(texts, queries, 12)  # the ranker's top 12 from the same rows
    for text, query, row in zip(texts, queries, best, strict=True):
        [(rows, scores)] = scored([text], query[None])
        assert row.tolist() == rows[np.argsort(-scores, kind="stable")][np.arange(12) % len(rows)
                                                                          ].tolist()


def test_item_words_are_built_once_per_bundle(bundle):
    assert ItemWords.of(bundle) is ItemWords.of(bundle)
    assert len(ItemWords.of(bundle).sizes) == len(bundle.items)
