"""The index curve: quality and search cost of the served routes under each index choice
(`R4T_INDEX`), relative to the bundle's own exact index, written beside the evaluation reports.

Quality is the harness's (coverage@10 and recall@5k of `single` and `diffusion`); cost is the
served paths' own `search` stage clock, one query at a time (one client) and in batches of 64.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from tqdm import tqdm

from service.artifacts.bundle import REPORTS_DIR, Bundle, load_bundle
from service.errors import BundleError
from service.routes.answer import RouteQuery, searched_s
from service.routes.diffusion import DiffusionRoute
from service.routes.single import SingleRoute
from service.runtime.encoder import Encoder
from service.runtime.index import FaissIndex, IndexChoice, chosen_index
from service.runtime.sampler import DiffusionSampler
from training.data.splits import load_split
from training.evaluation.harness import evaluate

CHOICES = ("bundle", "HNSW32/efSearch=64", "HNSW32/efSearch=128", "HNSW32/efSearch=256")
CURVE_DIR = "index_curve"
ONE_AT_A_TIME = 30  # queries timed one by one
BATCH = 64
COLUMNS = ("index", "single coverage@10", "diffusion coverage@10", "coverage vs exact",
           "diffusion recall@5k", "single search ms (1 query)",
           "diffusion search ms (1 query)", "diffusion search ms/query (batch 64)")


def search_ms(path: Any, texts: list[str], k: int) -> dict[str, float]:
    """Median ms of the stages that search (`context`, `search`) of one query at a time, and
    per query in a batch of 64."""
    alone = [searched_s(path([RouteQuery(t, k)])[0].timings_s) for t in texts[:ONE_AT_A_TIME]]
    batch = [texts[i % len(texts)] for i in range(BATCH)]
    best = min(searched_s(path([RouteQuery(t, k) for t in batch])[0].timings_s)
               for _ in range(3))
    return {"one_ms": 1e3 * float(np.median(alone)), "batch_ms_per_query": 1e3 * best / BATCH}


def point(bundle: Bundle, choice: str, split: str, k: int, seeds: int,
          encoder: Encoder) -> dict[str, Any]:
    texts = [q.query for q in load_split(bundle.path, split)]
    single = SingleRoute(bundle, encoder)
    diffusion = DiffusionRoute(bundle, encoder, DiffusionSampler(bundle.path / "diffusion"), 0)
    for path in (single, diffusion):
        path([RouteQuery(t, k) for t in texts[:8]])  # warm-up
    quality = {m: evaluate(bundle, m, split, k, encoder=encoder, seeds=seeds)["metrics"]
               for m in ("single", "diffusion")}
    return {"index": choice, "single": quality["single"], "diffusion": quality["diffusion"],
            "single_search": search_ms(single, texts, k),
            "diffusion_search": search_ms(diffusion, texts, k)}


def own_faiss(index: Any) -> faiss.Index:
    if not isinstance(index, FaissIndex):
        raise BundleError("the index curve compares FAISS indexes over the bundle's rows")
    return index.faiss


def index_curve(bundle_dir: Path, split: str = "test", choices: tuple[str, ...] = CHOICES,
                k: int = 10, seeds: int = 4) -> dict[str, Any]:
    """One point per index choice; each built index is reused across its search parameters."""
    own = load_bundle(bundle_dir)
    encoder = Encoder(own.encoder_config)
    built: dict[str, Any] = {"": own_faiss(own.index)}
    points = []
    for name in tqdm(choices, desc=f"index curve/{split}", unit="index"):
        choice = IndexChoice.parse(name)
        if choice.factory not in built:
            built[choice.factory] = chosen_index(built[""], own.items.embeddings,
                                                 IndexChoice(choice.factory))
        index = chosen_index(faiss.clone_index(built[choice.factory]), own.items.embeddings,
                             IndexChoice("", choice.params))  # a copy: params never carry over
        started = time.perf_counter()
        served = FaissIndex(index, own.items.metadata, name, own.items.embeddings)
        points.append(point(dataclasses.replace(own, index=served), name, split, k, seeds,
                            encoder))
        points[-1]["seconds"] = time.perf_counter() - started
    exact = next((p["diffusion"]["coverage@10"] for p in points if p["index"] == "bundle"), None)
    for p in points:
        if exact:
            p["coverage_vs_exact"] = p["diffusion"]["coverage@10"] / exact
    return {"split": split, "k": k, "seeds": seeds, "points": points}


def write_index_curve(bundle_dir: Path, curve: dict[str, Any]) -> Path:
    """eval/index_curve/<split>.json and a markdown table next to it."""
    directory = bundle_dir / REPORTS_DIR / CURVE_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{curve['split']}.json"
    path.write_text(json.dumps(curve, indent=2) + "\n")
    lines = [f"# Index curve ({curve['split']}, {curve['seeds']} seeds)", "",
             "| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    for p in curve["points"]:
        cells = [p["index"], p["single"]["coverage@10"], p["diffusion"]["coverage@10"],
                 p.get("coverage_vs_exact"), p["diffusion"]["recall@5k"],
                 p["single_search"]["one_ms"], p["diffusion_search"]["one_ms"],
                 p["diffusion_search"]["batch_ms_per_query"]]
        lines.append("| " + " | ".join(c if isinstance(c, str) else
                                        "–" if c is None else f"{c:.3f}" for c in cells) + " |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return path


def run_index_curve(bundle_dir: Path, split: str, k: int, seeds: int) -> Path:
    """`r4t eval --index-curve`: compute, write and print the curve; returns the JSON path."""
    path = write_index_curve(bundle_dir, index_curve(bundle_dir, split, k=k, seeds=seeds))
    print(path.with_suffix(".md").read_text())
    return path
