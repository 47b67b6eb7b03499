"""The ranked route's chooser: the candidates and features the catalog's text gives, the
label-free order, the redundancy penalty, and the config a bundle records."""

from __future__ import annotations

import importlib.abc
import json
import sys

import numpy as np
import pytest

from service.artifacts.bundle import load_bundle
from service.artifacts.lexical import MAX_QUERY_WORDS
from service.errors import BundleError
from service.ranker.mentions import (
    ABSENT_RANK,
    END,
    FEATURES,
    MENTION_BYTES,
    NO_MENTION,
    START,
    CandidateSizes,
    MentionFeatures,
    MentionWords,
)
from service.ranker.ranker import (
    RANKER_CONFIG,
    RANKER_MODEL,
    Ranker,
    RankerConfig,
    ScoredCandidates,
)
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
    worded = RankerConfig(words=MentionWords(("a", START), ("of", END)))
    assert RankerConfig.from_dict(json.loads(json.dumps(worded.to_dict()))) == worded
    with pytest.raises(BundleError, match="catalog` rebuilds it"):
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



def test_served_features_carry_the_words_either_side_of_each_mention(bundle):
    text = "tree"
    query = Encoder(bundle.encoder_config).encode([text])  # (1, d)
    plain = MentionFeatures(bundle, CandidateSizes(hybrid=8, mentions=1000))
    [(rows, listed)] = plain.candidates([text], query)
    around = plain.neighbours(text, rows)
    vocabulary = MentionWords(tuple(dict.fromkeys(b for b, _ in around)),
                              tuple(dict.fromkeys(a for _, a in around)))
    worded = MentionFeatures(bundle, CandidateSizes(hybrid=8, mentions=1000), vocabulary)
    column = dict(zip(FEATURES, worded.features(text, query[0], rows, listed).T, strict=True))
    expected = np.array([vocabulary.ids(b, a) for b, a in around])  # (C, 2)
    assert (column["word_before_mention"] == expected[:, 0]).all()
    assert (column["word_after_mention"] == expected[:, 1]).all()
    mentioned = np.isin(rows, bundle.lexical.mentions(text))
    # an item whose text never names the query has no words around a mention
    assert all(b == NO_MENTION for (b, _), m in zip(around, mentioned, strict=True) if not m)
    assert any(b != NO_MENTION for b, _ in around)


def test_scorers_share_features_only_when_they_read_the_same_words(bundle):
    words = MentionWords(("a",), ("of",))
    plain = MentionFeatures(bundle)
    worded = plain.with_words(words)
    assert worded.words == words and plain.words == MentionWords()
    assert worded.item_words is plain.item_words  # the items read once per bundle
    ranker = Ranker(RankerConfig(model=None, words=words))
    assert ScoredCandidates(bundle, ranker, worded).features is worded
    with pytest.raises(ValueError, match="sizes and words"):
        ScoredCandidates(bundle, ranker, plain)


def test_mention_lists_are_kept_by_their_searched_tokens_within_a_byte_budget(bundle):
    features = MentionFeatures(bundle)
    first = features.mentions("Dogs!")
    assert len(first) and features.mentions("dog") is first  # one entry for one word
    cache = features._mentions.cache
    assert cache.maxsize == MENTION_BYTES and cache.currsize == first.nbytes


def test_a_long_query_is_read_for_its_first_words_only(bundle):
    """A 1,000-word query costs its first MAX_QUERY_WORDS words' tokens, not a scan of every
    word per candidate."""
    features = MentionFeatures(bundle, CandidateSizes(hybrid=8, mentions=50))
    assert len(features.tokens("dog " * 1000)) == MAX_QUERY_WORDS
    query = Encoder(bundle.encoder_config).encode(["dog " * 1000])
    [(rows, hybrid)] = features.candidates(["dog " * 1000], query)
    table = features.features("dog " * 1000, query[0], rows, hybrid)
    short = features.features("dog " * MAX_QUERY_WORDS, query[0], rows, hybrid)
    np.testing.assert_array_equal(table, short)


class BrokenLibrary(importlib.abc.MetaPathFinder):
    """lightgbm as the slim image imports it without libgomp: an OSError, not an ImportError."""

    def find_spec(self, name: str, *args: object) -> None:
        if name == "lightgbm":
            raise OSError("libgomp.so.1: cannot open shared object file")


def test_a_ranker_whose_library_cannot_load_is_a_missing_runtime(tmp_path, monkeypatch):
    """An ImportError naming the package to install: the assembly leaves the ranked route out
    (as for any missing runtime) instead of refusing the whole bundle."""
    import lightgbm

    rows = np.random.default_rng(0).normal(size=(40, len(FEATURES)))
    data = lightgbm.Dataset(rows, label=np.arange(40) % 3, group=[10] * 4)
    lightgbm.train({"objective": "lambdarank", "verbose": -1}, data, num_boost_round=2
                   ).save_model(str(tmp_path / RANKER_MODEL))
    (tmp_path / RANKER_CONFIG).write_text(json.dumps(RankerConfig().to_dict()))
    assert Ranker.load(tmp_path).booster is not None
    monkeypatch.setitem(sys.modules, "lleaves", None)  # LightGBM serves without lleaves
    monkeypatch.delitem(sys.modules, "lightgbm")
    monkeypatch.setattr(sys, "meta_path", [BrokenLibrary(), *sys.meta_path])
    with pytest.raises(ImportError, match="libgomp1"):
        Ranker.load(tmp_path)


def test_the_compiled_ranker_scores_as_lightgbm_does(bundle, tmp_path, monkeypatch):
    """lleaves' machine code and LightGBM's tree walk give one score per candidate (the served
    top 12 cannot move), categorical words included; a model file is compiled once a process,
    and a restart loads the machine code kept for it instead of compiling again."""
    import tempfile

    from service.artifacts.bundle import sha256_file
    from service.ranker.booster import (
        CompiledBooster,
        LightGBMBooster,
        load_booster,
        object_file,
    )

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    from service.ranker.mentions import CATEGORICAL
    from training.ranker.lambdarank import RankerTrainConfig, fit

    words = MentionWords(("a", "the", NO_MENTION), ("of", END, NO_MENTION))
    features = MentionFeatures(bundle, CandidateSizes(hybrid=20, mentions=200), words)
    texts = ["tree", "dog", "musical instrument", "plant", "animal", "zzqx"]
    query = Encoder(bundle.encoder_config).encode(texts)
    found = features.candidates(texts, query)
    tables = [features.features(t, q, rows, listed)
              for t, q, (rows, listed) in zip(texts, query, found, strict=True)]
    table = np.concatenate(tables)
    labels = (table[:, FEATURES.index("mention_position")] < 3).astype(int)  # any signal
    booster = fit(table, labels, [len(t) for t in tables], RankerTrainConfig(rounds=40))
    booster.save_model(str(tmp_path / RANKER_MODEL))
    (tmp_path / RANKER_CONFIG).write_text(json.dumps(RankerConfig(model=RANKER_MODEL,
                                                                  words=words).to_dict()))
    served = Ranker.load(tmp_path)
    assert isinstance(served.booster, CompiledBooster)
    assert load_booster(tmp_path / RANKER_MODEL) is served.booster
    walked = LightGBMBooster(booster).predict(table)
    np.testing.assert_allclose(served.score(table), walked, rtol=0, atol=1e-9)
    assert np.ptp(walked) > 0 and len(np.unique(table[:, FEATURES.index(CATEGORICAL[0])])) > 1
    kept = object_file(sha256_file(tmp_path / RANKER_MODEL))
    assert kept is not None and kept.is_file() and kept.parent.parent == tmp_path
    restarted = CompiledBooster(tmp_path / RANKER_MODEL, kept)  # loaded from the file
    np.testing.assert_array_equal(restarted.predict(table), served.score(table))
