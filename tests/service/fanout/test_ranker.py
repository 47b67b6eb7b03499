"""The ranked route's chooser: the candidates and features the catalog's text gives, the
label-free order, the redundancy penalty, and the config a bundle records."""

from __future__ import annotations

import numpy as np
import pytest

from service.artifacts.bundle import load_bundle
from service.errors import BundleError
from service.fanout.mentions import ABSENT_RANK, FEATURES, CandidateSizes, MentionFeatures
from service.fanout.ranker import Ranker, RankerConfig
from service.runtime.encoder import Encoder


@pytest.fixture(scope="module")
def bundle(small_bundle_dir):
    return load_bundle(small_bundle_dir)


def unit(*rows: list[float]) -> np.ndarray:
    matrix = np.array(rows, dtype=np.float64)
    return matrix / np.linalg.norm(matrix, axis=1, keepdims=True)


def test_redundancy_trades_a_near_duplicate_for_another_branch():
    embeddings = unit([1, 0], [1, 0.01], [0, 1])  # 0 and 1 near-duplicates, 2 elsewhere
    scores = np.array([3.0, 2.9, 2.5])
    greedy = Ranker(RankerConfig(redundancy=0.0))
    spread = Ranker(RankerConfig(redundancy=1.0))
    assert greedy.choose(scores, embeddings, 2) == [0, 1]
    assert spread.choose(scores, embeddings, 2) == [0, 2]
    assert spread.choose(scores, embeddings, 5) == [0, 2, 1]  # never more than it has


def test_label_free_order_prefers_an_early_mention_then_similarity():
    table = np.zeros((3, len(FEATURES)), dtype=np.float32)
    position, similarity = FEATURES.index("mention_position"), FEATURES.index("similarity")
    table[:, position] = [ABSENT_RANK, 1, 1]
    table[:, similarity] = [0.9, 0.2, 0.4]
    scores = Ranker(RankerConfig(model=None)).score(table)
    assert list(np.argsort(-scores)) == [2, 1, 0]


def test_config_round_trips_and_other_features_are_refused():
    config = RankerConfig(CandidateSizes(20, 40), 0.5, FEATURES, None)
    assert RankerConfig.from_dict(config.to_dict()) == config
    with pytest.raises(BundleError, match="r4t train ranker"):
        Ranker(RankerConfig(features=FEATURES[:-1]))


def test_candidates_hold_the_hybrid_list_then_every_mention_and_features_say_so(bundle):
    features = MentionFeatures(bundle, CandidateSizes(hybrid=8, mentions=1000))
    text = "tree"
    query = Encoder(bundle.encoder_config).encode([text])  # (1, d)
    [(rows, listed)] = features.candidates([text], query)
    mentions = bundle.lexical.mentions(text)
    assert len(mentions) and listed <= 8 and len(set(rows.tolist())) == len(rows)
    assert set(mentions.tolist()) <= set(rows.tolist())
    table = features.features(text, query[0], rows, listed)
    assert table.shape == (len(rows), len(FEATURES))
    column = dict(zip(FEATURES, table.T, strict=True))
    assert (column["hybrid_rank"][:listed] == np.arange(listed)).all()
    assert (column["hybrid_rank"][listed:] == ABSENT_RANK).all()
    holds = np.isin(rows, mentions)
    assert (column["mentions"] == holds).all()
    assert np.allclose(column["similarity"], bundle.items.embeddings[rows] @ query[0], atol=1e-5)
