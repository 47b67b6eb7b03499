"""A standalone student's mention columns: the ranker's features of each context item in a fixed
encoding, from the bundle's lexical index alone."""

from __future__ import annotations

import numpy as np
import pytest

from service.artifacts.bundle import load_bundle
from service.ranker.mention_context import (
    COMPACT_WIDTH,
    MENTION_WIDTH,
    NUMERIC,
    WORDS,
    MentionContext,
    MentionedNeighbourhood,
    encode_mentions,
    leading_mentions,
    mention_columns,
    one_hot,
)
from service.ranker.mentions import ABSENT_RANK, FEATURES, MentionFeatures, MentionWords
from service.runtime.encoder import Encoder
from service.runtime.index import neighbour_rows


@pytest.fixture(scope="module")
def bundle(small_bundle_dir):
    return load_bundle(small_bundle_dir)


def test_the_encoding_keeps_a_mention_s_place_and_its_words():
    table = np.zeros((2, len(FEATURES)), dtype=np.float32)
    column = {name: i for i, name in enumerate(FEATURES)}
    table[0, column["mention_position"]] = 0  # named first
    table[1, column["mention_position"]] = ABSENT_RANK  # not named
    table[0, column["word_after_mention"]] = 3
    table[1, column["word_after_mention"]] = WORDS + 7  # an unknown word: the last slot
    encoded = encode_mentions(table, context=2)
    assert encoded.shape == (2, MENTION_WIDTH)
    position = NUMERIC.index("mention_position")
    assert encoded[0, position] == 0.0 and encoded[1, position] == pytest.approx(1.0)
    assert encoded[:, NUMERIC.index("rank")].tolist() == [0.0, 0.5]
    after = encoded[:, len(NUMERIC) + WORDS + 1:]  # the after side's one-hot
    assert after[0].argmax() == 3 and after[1].argmax() == WORDS and (after.sum(1) == 1).all()


def test_the_columns_are_the_ranker_s_features_of_the_query_s_nearest(bundle):
    words = MentionWords(("a", "the"), ("of",))
    texts = ["tree", "dog", "zzqx"]
    queries = Encoder(bundle.encoder_config).encode(texts)
    rows = neighbour_rows(bundle.index, queries, 8)  # (3, 8)
    columns = MentionContext(bundle, words)(texts, queries, rows)
    assert columns.shape == (3, 8, COMPACT_WIDTH)
    table = MentionFeatures(bundle, words=words).table(texts, queries, [(r, 0) for r in rows])
    np.testing.assert_array_equal(columns.reshape(-1, COMPACT_WIDTH), mention_columns(table, 8))
    # the served ids, one-hot, are what the student trains on
    np.testing.assert_array_equal(one_hot(columns).reshape(-1, MENTION_WIDTH),
                                  encode_mentions(table, 8))
    named = columns[..., NUMERIC.index("mention_position")] < 1.0
    assert named[0].any() and not named[2].any()  # "tree" is named, a never-seen word is not


def test_a_mentioned_context_leads_with_the_nearest_mentions_then_the_nearest(bundle):
    texts = ["tree", "zzqx"]
    queries = Encoder(bundle.encoder_config).encode(texts)
    features = MentionFeatures(bundle)
    n = 3 * 20  # leads with up to 40 mentions
    rows = MentionedNeighbourhood(features, bundle.index, n).rows(texts, queries)
    assert rows.shape == (2, n) and all(len(set(r.tolist())) == n for r in rows)
    held = features.mentions("tree")
    assert 0 < len(held) < leading_mentions(n)  # the small catalog: every mention leads
    lead = rows[0, : len(held)]
    assert set(lead.tolist()) == set(held.tolist())
    similarity = bundle.items.embeddings[lead] @ queries[0]
    assert (np.diff(similarity) <= 1e-6).all()  # nearest first
    nearest = neighbour_rows(bundle.index, queries, n)
    fill = [r for r in nearest[0].tolist() if r not in set(held.tolist())]
    assert rows[0, len(held):].tolist() == fill[: n - len(held)]
    np.testing.assert_array_equal(rows[1], nearest[1])  # no mention: the nearest alone


def test_a_small_context_keeps_two_thirds_for_the_nearest_mentions(bundle):
    texts = ["tree"]
    queries = Encoder(bundle.encoder_config).encode(texts)
    features = MentionFeatures(bundle)
    held = features.mentions("tree")
    n = 6
    lead = leading_mentions(n)
    assert lead == 4 and len(held) > lead  # more mentions than the context leads with
    rows = MentionedNeighbourhood(features, bundle.index, n).rows(texts, queries)[0]
    similarity = bundle.items.embeddings[held] @ queries[0]
    assert rows[:lead].tolist() == held[np.argsort(-similarity, kind="stable")][:lead].tolist()
    nearest = neighbour_rows(bundle.index, queries, n)[0].tolist()
    assert rows[lead:].tolist() == [r for r in nearest if r not in set(rows[:lead].tolist())][
        : n - lead]
