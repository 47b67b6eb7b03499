"""The `routes` stage: which fan-out route a bundle serves by default, measured on its own val
split, so no user is served a learned model that loses to a cheaper route on their catalog.

The last stage of `r4t bundle`: each fan-out route the bundle has (diffusion, ranked, hybrid)
and `single` run through the harness on val. Among the fan-out routes whose recall@5k is not
below single's by more than `tie_se` paired standard errors (a few val queries' noise must not
hand a catalog to `single`), those within `tie_se` paired se of the best coverage@10 are tied,
and the cheapest (this process's CPU per answer, for tied routes the median of `rounds`
interleaved passes on the served index in the same run) becomes the default arm (single
when none keeps its recall), beside the AR arm's share when the bundle has an AR policy. The
table and the weights land in `routes.json`, which the service reads when R4T_ROUTES is
unset.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.artifacts.bundle import (
    config_hash,
    load_bundle,
    read_manifest,
    stage,
)
from service.artifacts.stages import AR_POLICIES, ROUTE_STAGES, ROUTES_FILE
from service.routes import ROUTE_ORDER
from service.runtime.index import IndexChoice
from service.settings import Settings
from training.data.metrics import standard_error
from training.evaluation.harness import evaluate

# served routes the harness runs by the same name, best first
FANOUT_ROUTES = tuple(r for r in ROUTE_ORDER if r in ROUTE_STAGES)


@dataclass(frozen=True)
class RoutesConfig:
    split: str = "val"
    seeds: int = 1
    metric: str = "coverage@10"
    ar_share: float = 0.1  # the AR arm's weight beside the winner, when the bundle has one
    candidates: tuple[str, ...] = FANOUT_ROUTES  # the fan-out routes measured, when built
    tie_se: float = 2.0  # routes closer than this many paired se to the best are tied
    # passes over the split, route after route, of the routes tied on quality, on the index the
    # service searches: their price is the median CPU per answer, and a route must be cheaper
    # in every pass to win on price (one pass on the exact index let the machine's drift
    # decide a tie)
    rounds: int = 3


COST = "cpu_ms_per_query"  # the harness's CPU per answer: the price ties are broken by
COST_ROUNDS = "cpu_ms_per_query_rounds"  # that price in each pricing round, when measured
PER_QUERY = "per_query"  # a table row's per-query values of the metric, for the paired tie
PER_QUERY_RECALL = "per_query_recall@5k"  # and of recall@5k, for the paired floor


def routes_stage_config(config: RoutesConfig = RoutesConfig()) -> dict[str, Any]:
    return asdict(config)


def choose(table: dict[str, dict[str, Any]], config: RoutesConfig) -> str:
    """The cheapest of the `contenders` (single when there are none); where their prices were
    measured in rounds, only a route cheaper in every round displaces the first of them in
    ROUTE_ORDER (rounds that disagree are the machine's noise, not a price)."""
    tied = contenders(table, config)
    if not tied:
        return "single"
    cheapest = min(tied, key=lambda r: (table[r].get(COST, 0.0), FANOUT_ROUTES.index(r)))
    first = min(tied, key=FANOUT_ROUTES.index)
    rounds = [table[r].get(COST_ROUNDS) for r in (cheapest, first)]
    if None in rounds or cheapest == first:
        return cheapest
    return cheapest if all(a < b for a, b in zip(*rounds, strict=True)) else first


def contenders(table: dict[str, dict[str, Any]], config: RoutesConfig) -> list[str]:
    """The fan-out routes tied with the best by `config.metric` (within `tie_se` paired se,
    where the rows hold per-query values), among those whose recall@5k is at least single's
    or within `tie_se` paired se of it: their prices decide."""
    single = table["single"]
    fair = [r for r in FANOUT_ROUTES if r in table and (
        table[r]["recall@5k"] >= single["recall@5k"]
        or _tied(single, table[r], config.tie_se, PER_QUERY_RECALL))]
    if not fair:
        return []
    best = max(fair, key=lambda r: table[r][config.metric])
    return [r for r in fair if r == best or _tied(table[best], table[r], config.tie_se)]


def _tied(best: dict[str, Any], other: dict[str, Any], tie_se: float,
          values: str = PER_QUERY) -> bool:
    """Whether `other` is within `tie_se` paired standard errors of `best`, by their per-query
    `values`."""
    if values not in best or values not in other:
        return False
    diff = np.asarray(best[values], dtype=float) - np.asarray(other[values], dtype=float)
    return float(diff.mean()) <= tie_se * standard_error(diff)


def price(bundle_dir: Path, tied: list[str], config: RoutesConfig
          ) -> tuple[str, dict[str, list[float]]]:
    """The index the service searches (R4T_INDEX), and on it each tied route's CPU per answer
    in each of `rounds` passes, route after route (a drift of the machine hits each)."""
    choice = IndexChoice.parse(Settings(bundle=bundle_dir).index)
    served = load_bundle(bundle_dir, choice)
    costs: dict[str, list[float]] = {route: [] for route in tied}
    for _ in range(config.rounds):
        for route in tied:
            costs[route].append(float(evaluate(served, route, config.split)["diagnostics"][COST]))
    return choice.name, costs


def measured(report: dict[str, Any], config: RoutesConfig) -> dict[str, Any]:
    """A route's row of the routes table from its harness report."""
    metrics = report["metrics"]
    row: dict[str, Any] = {m: float(metrics[m]) for m in ("coverage@10", "recall@5k",
                                                         "precision@10", "latency_ms_per_query")}
    row[COST] = float(report["diagnostics"][COST])
    row[PER_QUERY] = report["diagnostics"]["per_query"][config.metric]
    row[PER_QUERY_RECALL] = report["diagnostics"]["per_query"]["recall@5k"]
    return row


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
    table = {route: measured(evaluate(bundle, route, config.split, seeds=config.seeds), config)
             for route in routes}
    tied = contenders(table, config)
    priced = price(bundle_dir, tied, config) if len(tied) > 1 else None
    for route in tied if priced else ():
        table[route][COST] = float(np.median(priced[1][route]))
        table[route][COST_ROUNDS] = priced[1][route]
    best = choose(table, config)
    served = weights(best, any(p in stages for p in AR_POLICIES), config)
    print(f"routes on {config.split}: " + ", ".join(
        f"{r} {row['coverage@10']:.3f} coverage@10 / {row['recall@5k']:.3f} recall@5k / "
        f"{row[COST]:.2f} ms"
        for r, row in table.items())
        + ("" if priced is None else f" (the tied priced on {priced[0]})")
        + f"\nroutes: serving {served} (R4T_ROUTES overrides)",
        flush=True)
    key = routes_stage_config(config)
    record: dict[str, Any] = {"config": key, "config_hash": config_hash(key), "weights": served}
    with stage(bundle_dir, manifest, "routes", record) as staged:
        (staged / ROUTES_FILE).write_text(json.dumps(
            {"weights": served, "split": config.split, "metric": config.metric,
             "table": table}, indent=2) + "\n")
        record["wall_s"] = round(time.perf_counter() - started, 2)
    return read_manifest(bundle_dir)
