"""The `routes` stage: which fan-out route a bundle serves by default, measured on its own val
split, so no user is served a learned model that loses to a cheaper route on their catalog.

The last stage of `r4t bundle`: each fan-out route the bundle has (diffusion, ranked, hybrid) and
`single` run through the harness on val; the fan-out route with the best coverage@10 whose
recall@5k is not below single's becomes the default arm (single when none is), beside the AR
arm's share when the bundle has an AR policy. The table and the weights land in
`routes.json`, which the service reads when R4T_ROUTES is unset.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from service.artifacts.bundle import (
    ROUTES_FILE,
    config_hash,
    load_bundle,
    read_manifest,
    stage,
)
from service.routes import ROUTE_ORDER
from training.evaluation.harness import evaluate

# fan-out route: the stage it needs (its model's; `hybrid` has none, only the lexical index)
ROUTE_STAGES = {"diffusion": "diffusion", "ranked": "ranker", "hybrid": "lexical"}
# served routes the harness runs by the same name, best first
FANOUT_ROUTES = tuple(r for r in ROUTE_ORDER if r in ROUTE_STAGES)
AR_POLICIES = ("folm", "folm-warmstart", "llm")


@dataclass(frozen=True)
class RoutesConfig:
    split: str = "val"
    seeds: int = 1
    metric: str = "coverage@10"
    ar_share: float = 0.1  # the AR arm's weight beside the winner, when the bundle has one
    candidates: tuple[str, ...] = FANOUT_ROUTES  # the fan-out routes measured, when built


def routes_stage_config(config: RoutesConfig = RoutesConfig()) -> dict[str, Any]:
    return asdict(config)


def choose(table: dict[str, dict[str, float]], config: RoutesConfig) -> str:
    """The best fan-out route by `config.metric` whose recall@5k is at least single's."""
    floor = table["single"]["recall@5k"]
    fair = [r for r in FANOUT_ROUTES if r in table and table[r]["recall@5k"] >= floor]
    return max(fair, key=lambda r: table[r][config.metric], default="single")


def weights(best: str, has_ar: bool, config: RoutesConfig) -> str:
    """R4T_ROUTES's form: the winner, and the AR arm's share when there is one."""
    if not has_ar or best == "single":
        return f"{best}=1"
    return f"{best}={1 - config.ar_share:g},ar={config.ar_share:g}"


def select_routes(bundle_dir: Path, config: RoutesConfig = RoutesConfig()) -> dict[str, Any]:
    """Measure, choose, print and commit the routes stage; returns the manifest."""
    started = time.perf_counter()
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    stages = manifest.get("stages", {})
    routes = [r for r in FANOUT_ROUTES if ROUTE_STAGES[r] in stages] + ["single"]
    bundle = load_bundle(bundle_dir)
    table = {}
    for route in routes:
        metrics = evaluate(bundle, route, config.split, seeds=config.seeds)["metrics"]
        table[route] = {m: float(metrics[m]) for m in ("coverage@10", "recall@5k",
                                                      "precision@10", "latency_ms_per_query")}
    best = choose(table, config)
    served = weights(best, any(p in stages for p in AR_POLICIES), config)
    print(f"routes on {config.split}: " + ", ".join(
        f"{r} {row['coverage@10']:.3f} coverage@10 / {row['recall@5k']:.3f} recall@5k"
        for r, row in table.items()) + f"\nroutes: serving {served} (R4T_ROUTES overrides)",
        flush=True)
    key = routes_stage_config(config)
    record: dict[str, Any] = {"config": key, "config_hash": config_hash(key), "weights": served}
    with stage(bundle_dir, manifest, "routes", record) as staged:
        (staged / ROUTES_FILE).write_text(json.dumps(
            {"weights": served, "split": config.split, "metric": config.metric,
             "table": table}, indent=2) + "\n")
        record["wall_s"] = round(time.perf_counter() - started, 2)
    return read_manifest(bundle_dir)
