"""The `ranker` stage: a teacher that learns the catalog from labeled queries.

LightGBM's lambdarank over each train query's candidates (service.fanout.mentions), an item
labeled 1 when it sits in one of the query's groups; trained only on the train queries that
share no item with val or test (training.data.splits.disjoint_train). The set objective's one
free weight, the redundancy penalty, is chosen on val's coverage@10. A benchmark without labels
gets the label-free mention order instead. Seconds on a CPU; no torch.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from service.artifacts.bundle import config_hash, git_commit, load_bundle, read_manifest, stage
from service.fanout.mentions import FEATURES, CandidateSizes
from service.fanout.ranker import RANKER_CONFIG, RANKER_DIR, RANKER_MODEL, Ranker, RankerConfig
from service.paths.ranked import RankedPath
from service.runtime.encoder import Encoder
from training.data.splits import BenchmarkQuery, disjoint_train, load_split
from training.evaluation.metrics import group_hit_rate

K = 10


@dataclass(frozen=True)
class RankerTrainConfig:
    """LightGBM's lambdarank settings and the redundancy weights tried on val."""

    rounds: int = 300
    learning_rate: float = 0.05
    leaves: int = 15
    min_data_in_leaf: int = 20
    truncation: int = 20  # lambdarank_truncation_level: the top of each list matters
    redundancies: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0)
    hybrid: int = 50
    mentions: int = 300
    seed: int = 0


def ranker_stage_config(config: RankerTrainConfig) -> dict[str, Any]:
    """The ranker stage's key: its training config and the features it reads."""
    return {**asdict(config), "redundancies": list(config.redundancies),
            "features": list(FEATURES)}


def labeled(path: RankedPath, queries: list[BenchmarkQuery]
            ) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(features (N, F), labels (N,), rows per query) over the queries' candidates."""
    texts = [q.query for q in queries]
    embedded = path.encoder.encode(texts)  # (Q, d)
    tables, labels, sizes = [], [], []
    ids = path.bundle.items.ids
    pairs = zip(queries, embedded, path.features.candidates(texts, embedded), strict=True)
    for query, vector, (rows, listed) in tqdm(pairs, total=len(queries), desc="ranker rows"):
        reference = query.reference
        tables.append(path.features.features(query.query, vector, rows, listed))
        labels.append(np.array([ids[r] in reference for r in rows], dtype=np.int32))
        sizes.append(len(rows))
    return np.concatenate(tables), np.concatenate(labels), sizes


def fit(features: np.ndarray, labels: np.ndarray, sizes: list[int],
        config: RankerTrainConfig) -> Any:
    """A LightGBM lambdarank booster."""
    import lightgbm

    params = {"objective": "lambdarank", "learning_rate": config.learning_rate,
              "num_leaves": config.leaves, "min_data_in_leaf": config.min_data_in_leaf,
              "lambdarank_truncation_level": config.truncation, "seed": config.seed,
              "deterministic": True, "num_threads": 1, "verbose": -1}
    data = lightgbm.Dataset(features, labels, group=sizes)
    return lightgbm.train(params, data, num_boost_round=config.rounds)


def coverage(path: RankedPath, queries: list[BenchmarkQuery]) -> float:
    """Mean coverage@10 of the route's picks over labeled queries."""
    texts = [q.query for q in queries]
    chosen = path.choose(texts, path.encoder.encode(texts), [K] * len(queries))
    ids = path.bundle.items.ids
    return float(np.nanmean([group_hit_rate({ids[r] for r in rows}, q.groups)
                             for rows, q in zip(chosen, queries, strict=True)]))


def train_ranker(bundle_dir: Path, config: RankerTrainConfig = RankerTrainConfig()
                 ) -> dict[str, Any]:
    """Train, tune on val and commit the `ranker` stage; returns the manifest."""
    started = time.perf_counter()
    bundle_dir = Path(bundle_dir)
    bundle = load_bundle(bundle_dir)
    encoder = Encoder(bundle.encoder_config)
    sizes = CandidateSizes(config.hybrid, config.mentions)
    train = disjoint_train(bundle_dir)
    val = [q for q in load_split(bundle_dir, "val") if q.groups]
    booster = None
    if train:
        base = Ranker(RankerConfig(sizes=sizes))
        booster = fit(*labeled(RankedPath(bundle, encoder, base), train), config)
    served = RankerConfig(sizes=sizes, model=RANKER_MODEL if booster else None)
    tried = {}
    for weight in config.redundancies if val else (0.0,):
        candidate = RankerConfig(sizes, weight, FEATURES, served.model)
        path = RankedPath(bundle, encoder, Ranker(candidate, booster))
        tried[weight] = coverage(path, val) if val else float("nan")
        print(f"ranker: redundancy {weight}: val coverage@10 {tried[weight]:.3f}", flush=True)
    best = max(tried, key=lambda w: -np.inf if np.isnan(tried[w]) else tried[w])
    served = RankerConfig(sizes, best, FEATURES, served.model)
    manifest = read_manifest(bundle_dir)
    key = ranker_stage_config(config)
    record: dict[str, Any] = {"n_train_queries": len(train), "val_coverage@10": tried[best]}
    with stage(bundle_dir, manifest, "ranker", record) as staged:
        folder = staged / RANKER_DIR
        folder.mkdir()
        if booster is not None:
            booster.save_model(str(folder / RANKER_MODEL))
        (folder / RANKER_CONFIG).write_text(
            json.dumps({**served.to_dict(), "trained": {
                "config": key, "seed": config.seed, "git_commit": git_commit(),
                "n_train_queries": len(train), "val_coverage@10_by_redundancy":
                    {str(w): v for w, v in tried.items()}}}, indent=2) + "\n")
        record.update(config=key, config_hash=config_hash(key),
                      wall_s=round(time.perf_counter() - started, 2))
    return read_manifest(bundle_dir)
