"""The `ranker` stage: a teacher that learns the catalog from labeled queries.

LightGBM's lambdarank over each train query's candidates (service.ranker.mentions), an item
labeled 1 when it sits in one of the query's groups; no val or test item is ever a training row
(`train`: every train query with those items masked out, training.data.splits.masked_train, or
only the queries that share none, disjoint_train). The set objective's one
free weight, the redundancy penalty, is chosen on val's coverage@10, and the model is served
only where it beats the label-free mention order there (a benchmark without labels gets that
order). Seconds on a CPU; no torch.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from service.artifacts.bundle import (
    CONTENT_KEY,
    config_hash,
    git_commit,
    load_bundle,
    read_manifest,
    stage,
)
from service.errors import InputError
from service.ranker.booster import LightGBMBooster
from service.ranker.mentions import (
    CATEGORICAL,
    FEATURES,
    CandidateSizes,
    MentionFeatures,
    MentionWords,
)
from service.ranker.ranker import RANKER_CONFIG, RANKER_DIR, RANKER_MODEL, Ranker, RankerConfig
from service.routes.ranked import RankedRoute
from service.runtime.encoder import Encoder
from training.data.metrics import group_hit_rate
from training.data.splits import (
    BenchmarkQuery,
    disjoint_train,
    held_out_items,
    load_split,
    masked_train,
)

K = 10
TRAIN_SETS = {"masked": masked_train, "disjoint": disjoint_train}


@dataclass(frozen=True)
class RankerTrainConfig:
    """LightGBM's lambdarank settings and the redundancy weights tried on val."""

    rounds: int = 150  # 300 measured no better on val, and cost twice as much to serve
    learning_rate: float = 0.05
    leaves: int = 15
    min_data_in_leaf: int = 20
    truncation: int = 20  # lambdarank_truncation_level: the top of each list matters
    redundancies: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0)
    hybrid: int = 50
    mentions: int = 300  # per train query: a broad word's far mentions are negatives to learn
    # per served query: its picks come from the nearest mentions, and each row costs a score
    served_mentions: int = 60
    seed: int = 0
    # serve the label-free order instead where it measures at least as well on val
    label_free_baseline: bool = True
    train: str = "masked"  # TRAIN_SETS: which labeled train queries it learns from
    words: int = 30  # the most frequent words either side of a mention it tells apart, per side
    cat_smooth: float = 20.0  # LightGBM's smoothing of a categorical word's statistics
    min_data_per_group: int = 50  # rows a word needs to be split on
    # a group's head (its first item: the query's direct child, as WordNet's benchmark and
    # ICD-10's list it) is labelled this, its other members 1: lambdarank then ranks the
    # query's children above their descendants, one pick a branch
    head_label: int = 2


def served_sizes(config: RankerTrainConfig) -> CandidateSizes:
    """The candidates a served query is scored over (ranker.json's `sizes`)."""
    return CandidateSizes(config.hybrid, config.served_mentions)


def ranker_stage_config(config: RankerTrainConfig) -> dict[str, Any]:
    """The ranker stage's key: its training config and the features it reads."""
    return {**asdict(config), "redundancies": list(config.redundancies),
            "features": list(FEATURES)}


def labeled(path: RankedRoute, queries: list[BenchmarkQuery], held: set[str],
            head_label: int = 1) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(features (N, F), labels (N,), rows per query) over the queries' candidates, the
    `held` items (val's and test's) left out: neither a positive nor a negative. A member of
    a group is labelled 1, its first item (its head) `head_label`."""
    texts = [q.query for q in queries]
    embedded = path.encoder.encode(texts)  # (Q, d)
    tables, labels, sizes = [], [], []
    ids = path.bundle.items.ids
    pairs = zip(queries, embedded, path.features.candidates(texts, embedded), strict=True)
    for query, vector, (rows, listed) in tqdm(pairs, total=len(queries), desc="ranker rows"):
        grade = {item: 1 for item in query.reference} | {g[0]: head_label for g in query.groups}
        kept = np.array([ids[r] not in held for r in rows], dtype=bool)  # (C,)
        if not kept.any():
            continue
        tables.append(path.features.features(query.query, vector, rows, listed)[kept])
        labels.append(np.array([grade.get(ids[r], 0) for r in rows[kept]], dtype=np.int32))
        sizes.append(int(kept.sum()))
    return np.concatenate(tables), np.concatenate(labels), sizes


def learn_words(path: RankedRoute, queries: list[BenchmarkQuery], n: int) -> MentionWords:
    """The n most frequent words before and after a mention among the queries' candidates
    (label-free: which words the model may tell apart, not what they mean)."""
    texts = [q.query for q in queries]
    before: Counter[str] = Counter()
    after: Counter[str] = Counter()
    for text, (rows, _) in zip(texts, path.features.candidates(texts, path.encoder.encode(texts)),
                               strict=True):
        for word_before, word_after in path.features.neighbours(text, rows):
            before[word_before] += 1
            after[word_after] += 1
    return MentionWords(tuple(w for w, _ in before.most_common(n)),
                        tuple(w for w, _ in after.most_common(n)))


def learned_rows(bundle: Any, encoder: Encoder, sizes: CandidateSizes,
                 train: list[BenchmarkQuery], held: set[str], n_words: int, head_label: int = 1
                 ) -> tuple[MentionWords, np.ndarray, np.ndarray, list[int]]:
    """The words learned from the train queries' candidates, then their labeled rows
    (`labeled`) with those words: what the stage and its learning curve train on."""
    unworded = RankedRoute(bundle, encoder, Ranker(RankerConfig(sizes=sizes)))
    words = learn_words(unworded, train, n_words)
    path = RankedRoute(bundle, encoder, Ranker(RankerConfig(sizes=sizes, words=words)),
                       unworded.features.with_words(words))  # items read once, not twice
    return (words, *labeled(path, train, held, head_label))


def fit(features: np.ndarray, labels: np.ndarray, sizes: list[int],
        config: RankerTrainConfig) -> Any:
    """A LightGBM lambdarank booster, the mention's neighbouring words as categories."""
    import lightgbm

    params = {"objective": "lambdarank", "learning_rate": config.learning_rate,
              "num_leaves": config.leaves, "min_data_in_leaf": config.min_data_in_leaf,
              "lambdarank_truncation_level": config.truncation, "seed": config.seed,
              "cat_smooth": config.cat_smooth, "min_data_per_group": config.min_data_per_group,
              "deterministic": True, "num_threads": 1, "verbose": -1}
    data = lightgbm.Dataset(features, labels, group=sizes,
                            categorical_feature=[FEATURES.index(c) for c in CATEGORICAL])
    return lightgbm.train(params, data, num_boost_round=config.rounds)


def coverage(path: RankedRoute, queries: list[BenchmarkQuery]) -> float:
    """Mean coverage@10 of the route's picks over labeled queries."""
    texts = [q.query for q in queries]
    chosen = path.choose(texts, path.encoder.encode(texts), [K] * len(queries))
    ids = path.bundle.items.ids
    return float(np.nanmean([group_hit_rate({ids[r] for r in rows}, q.groups)
                             for rows, q in zip(chosen, queries, strict=True)]))


def tune(bundle: Any, encoder: Encoder, sizes: CandidateSizes, booster: Any | None,
         val: list[BenchmarkQuery], redundancies: tuple[float, ...], words: MentionWords,
         baseline: bool = True, report: bool = True,
         features: MentionFeatures | None = None) -> dict[RankerConfig, float]:
    """Val coverage@10 of each scorer (the trained model, and the label-free order, which a
    model must beat to be served) at each redundancy weight; NaN without labeled val. The
    scorers share one feature computer (`features`, else the bundle's with these words)."""
    tried: dict[RankerConfig, float] = {}
    features = features or MentionFeatures(bundle, sizes, words)
    models = [RANKER_MODEL] if booster is not None else []
    trained = None if booster is None else LightGBMBooster(booster)
    for model in ([None] if baseline or not models else []) + models:  # a tie: no model
        for weight in redundancies if val else (0.0,):
            config = RankerConfig(sizes, weight, FEATURES, model, words)
            path = RankedRoute(bundle, encoder, Ranker(config, trained if model else None),
                               features)
            tried[config] = coverage(path, val) if val else float("nan")
            if report:
                print(f"ranker: {model or 'label-free'}, redundancy {weight}: val "
                      f"coverage@10 {tried[config]:.3f}", flush=True)
    return tried


def train_ranker(bundle_dir: Path, config: RankerTrainConfig = RankerTrainConfig()
                 ) -> dict[str, Any]:
    """Train, tune on val and commit the `ranker` stage; returns the manifest."""
    started = time.perf_counter()
    bundle_dir = Path(bundle_dir)
    bundle = load_bundle(bundle_dir)
    encoder = Encoder(bundle.encoder_config)
    sizes = CandidateSizes(config.hybrid, config.mentions)
    if config.train not in TRAIN_SETS:
        raise InputError(f"unknown ranker train set {config.train!r}; use one of "
                         f"{sorted(TRAIN_SETS)}")
    train = TRAIN_SETS[config.train](bundle_dir)
    val = [q for q in load_split(bundle_dir, "val") if q.groups]
    booster, words = None, MentionWords()
    if train:
        words, *rows = learned_rows(bundle, encoder, sizes, train, held_out_items(bundle_dir),
                                    config.words, config.head_label)
        booster = fit(*rows, config)
    tried = tune(bundle, encoder, served_sizes(config), booster, val, config.redundancies, words,
                 config.label_free_baseline)
    served = max(tried, key=lambda c: -np.inf if np.isnan(tried[c]) else tried[c])
    if served.model is None:
        booster = None  # the label-free order measured at least as well on val
    manifest = read_manifest(bundle_dir)
    key = ranker_stage_config(config)
    record: dict[str, Any] = {"n_train_queries": len(train), "val_coverage@10": tried[served],
                              "model": served.model}
    with stage(bundle_dir, manifest, "ranker", record) as staged:
        folder = staged / RANKER_DIR
        folder.mkdir()
        if booster is not None:
            booster.save_model(str(folder / RANKER_MODEL))
        (folder / RANKER_CONFIG).write_text(
            json.dumps({**served.to_dict(), "trained": {
                "config": key, "seed": config.seed, "git_commit": git_commit(),
                "n_train_queries": len(train), "val_coverage@10": [
                    {"model": c.model, "redundancy": c.redundancy, "coverage@10": v}
                    for c, v in tried.items()]}}, indent=2) + "\n")
        record.update(config=key, config_hash=config_hash(key),
                      wall_s=round(time.perf_counter() - started, 2))
        # a function of its config and inputs (deterministic, one thread), not of the bytes
        # of a model file another CPU or commit may write differently (stage_hash)
        record[CONTENT_KEY] = {}
    return read_manifest(bundle_dir)
