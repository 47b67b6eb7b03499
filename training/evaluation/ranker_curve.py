"""Would more labels or a better set objective pay? The ranker's learning curve in labeled train
queries (a ranker trained on a share of them, its redundancy tuned on val, scored on val and the
split), and beside it the served ranker against two oracles over its own candidates: perfect
spread (its scores, never two picks in one group) and perfect membership (its greedy choice among
the query's true members). Diagnostics, never a training signal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from service.artifacts.bundle import REPORTS_DIR, Bundle, load_bundle
from service.errors import InputError
from service.ranker.booster import LightGBMBooster
from service.ranker.mentions import CandidateSizes, MentionFeatures
from service.ranker.ranker import Ranker
from service.routes.ranked import RankedRoute
from service.runtime.encoder import Encoder
from training.data.metrics import best_coverage, group_hit_rate, precision
from training.data.splits import held_out_items, load_split
from training.ranker.lambdarank import (
    TRAIN_SETS,
    K,
    RankerTrainConfig,
    coverage,
    fit,
    learned_rows,
    served_sizes,
    tune,
)

SHARES = (0.25, 0.5, 0.75, 1.0)
DRAWS = 3  # random subsets per share below 1 (the full share has one)
CURVE_DIR = "ranker-curve"


def split_rows(features: np.ndarray, labels: np.ndarray, sizes: list[int]
               ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each labeled train query's (features (C, F), labels (C,)), for subsets drawn of them."""
    bounds = np.cumsum(sizes)[:-1]
    return list(zip(np.split(features, bounds), np.split(labels, bounds), strict=True))


def learning_curve(bundle_dir: Path, split: str, shares: tuple[float, ...] = SHARES,
                   draws: int = DRAWS, config: RankerTrainConfig | None = None
                   ) -> list[dict[str, Any]]:
    """Per share and draw: train queries used, val coverage@10 at the best redundancy, and
    the split's at that redundancy (the ranker stage's default config unless given)."""
    config = config or RankerTrainConfig()
    bundle = load_bundle(bundle_dir)
    encoder = Encoder(bundle.encoder_config)
    sizes = CandidateSizes(config.hybrid, config.mentions)
    train = TRAIN_SETS[config.train](bundle_dir)
    val = [q for q in load_split(bundle_dir, "val") if q.groups]
    scored = [q for q in load_split(bundle_dir, split) if q.groups]
    if not (train and val and scored):
        raise InputError(f"the ranker curve needs labeled train, val and {split} queries; "
                         f"{bundle_dir}'s benchmark has {len(train)}, {len(val)} and "
                         f"{len(scored)}")
    words, *rows = learned_rows(bundle, encoder, sizes, train, held_out_items(bundle_dir),
                                config.words, config.head_label)
    blocks = split_rows(*rows)
    served = served_sizes(config)
    features = MentionFeatures(bundle, served, words)  # one per curve: its caches kept
    curve = []
    plan = [(s, d) for s in shares for d in range(draws if s < 1 else 1)]
    for share, draw in tqdm(plan, desc="ranker curve", unit="fit"):
        n = max(1, round(share * len(blocks)))
        chosen = np.sort(np.random.default_rng(draw).choice(len(blocks), n, replace=False))
        booster = fit(np.concatenate([blocks[i][0] for i in chosen]),
                      np.concatenate([blocks[i][1] for i in chosen]),
                      [len(blocks[i][1]) for i in chosen], config)
        tried = tune(bundle, encoder, served, booster, val, config.redundancies, words,
                     baseline=False, report=False, features=features)
        best = max(tried, key=tried.__getitem__)
        on_split = tried[best] if split == "val" else coverage(
            RankedRoute(bundle, encoder, Ranker(best, LightGBMBooster(booster)), features), scored)
        curve.append({"share": share, "draw": draw, "train_queries": n,
                      "redundancy": best.redundancy, "val_coverage@10": tried[best],
                      f"{split}_coverage@10": on_split})
    return curve


def oracles(bundle: Bundle, split: str) -> dict[str, float]:
    """The served ranker's coverage@10 and P@10 on the split, and over the same candidates:
    perfect spread, perfect membership and the label ceiling (best 10 of them)."""
    served = RankedRoute(bundle, Encoder(bundle.encoder_config))
    queries = [q for q in load_split(bundle.path, split) if q.groups]
    texts = [q.query for q in queries]
    ids, embeddings = bundle.items.ids, bundle.items.embeddings
    found: dict[str, list[float]] = {key: [] for key in (
        "ranked", "precision@10", "perfect spread", "perfect membership", "ceiling")}
    scored = served.scored(texts, served.encoder.encode(texts))
    for query, (rows, scores) in zip(queries, scored, strict=True):
        picks = rows[served.ranker.choose(scores, embeddings[rows], K)]
        member = np.array([ids[r] in query.reference for r in rows])  # (C,)
        kept = rows[member]
        among = kept[served.ranker.choose(scores[member], embeddings[kept], K)]
        found["ranked"].append(group_hit_rate({ids[r] for r in picks}, query.groups))
        found["precision@10"].append(precision([ids[r] for r in picks], query.reference))
        found["perfect spread"].append(spread(rows[np.argsort(-scores, kind="stable")],
                                              ids, query.groups))
        found["perfect membership"].append(group_hit_rate({ids[r] for r in among}, query.groups))
        found["ceiling"].append(best_coverage({ids[r] for r in rows}, query.groups))
    return {key: float(np.mean(values)) for key, values in found.items()}


def spread(ranked: np.ndarray, ids: list[str], groups: list[list[str]]) -> float:
    """Coverage@10 of rows taken best first, skipping any whose groups are all reached."""
    group_of: dict[str, set[int]] = {}
    for g, members in enumerate(groups):
        for item in members:
            group_of.setdefault(item, set()).add(g)
    reached: set[int] = set()
    taken = 0
    for row in ranked.tolist():
        mine = group_of.get(ids[row], set())
        if mine and mine <= reached:
            continue
        reached |= mine
        taken += 1
        if taken == K:
            break
    return len(reached) / len(groups)


def write_curve(bundle_dir: Path, split: str, rows: list[dict[str, Any]],
                served: dict[str, float]) -> Path:
    """eval/ranker-curve/<split>.json and the markdown tables beside it."""
    directory = bundle_dir / REPORTS_DIR / CURVE_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{split}.json"
    path.write_text(json.dumps({"split": split, "curve": rows, "oracles": served}, indent=2)
                    + "\n")
    keys = list(dict.fromkeys(["val_coverage@10", f"{split}_coverage@10"]))
    lines = [f"# The ranker's learning curve in labeled train queries ({split})", "",
             "| share | train queries | draws | "
             + " | ".join(k.replace("_", " ") for k in keys) + " |",
             "|---:|---:|---:|" + "---:|" * len(keys)]
    for share in sorted({r["share"] for r in rows}):
        mine = [r for r in rows if r["share"] == share]
        lines.append(f"| {share:.2f} | {mine[0]['train_queries']} | {len(mine)} | "
                     + " | ".join(f"{np.mean([r[k] for r in mine]):.3f}" for k in keys) + " |")
    lines += ["", f"## The served ranker against oracles over its candidates ({split})", "",
              "| the served ranker's choice, or an oracle's | coverage@10 (P@10 where named) |",
              "|---|---:|"]
    lines += [f"| {name} | {value:.3f} |" for name, value in served.items()]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return path


def run_ranker_curve(bundle_dir: Path, split: str, shares: tuple[float, ...] = SHARES,
                     draws: int = DRAWS) -> Path:
    """`r4t eval --ranker-curve`: compute, write and print; returns the JSON path."""
    rows = learning_curve(bundle_dir, split, shares, draws)
    path = write_curve(bundle_dir, split, rows, oracles(load_bundle(bundle_dir), split))
    print(path.with_suffix(".md").read_text())
    return path
