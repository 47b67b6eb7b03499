"""The figures shipped stages are shipped with, and the check that a bundle still reaches them.

`r4t ship` measures each route on the val split over several seeds (the exact index, the
harness's own path objects); the test suite re-runs seed 0 on a bundle that adopted the
shipped stages and fails when a figure moves: a deterministic route's at all, a sampled
route's by more than a multiple of its seeds' spread, or when a learned route no longer leads
`hybrid` by a margin, so that a change which silently degrades the shipped model fails CI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from service.artifacts.bundle import load_bundle
from service.artifacts.stages import AR_STAGE
from service.runtime.encoder import Encoder
from service.runtime.index import IndexChoice
from training.evaluation.harness import evaluate, write_report

SPLIT = "val"
# the served routes, and the prompt order
METHODS = ("diffusion", "ranked", AR_STAGE, "hybrid", "single", "hybrid-names")
CHECKED = ("diffusion", "ranked", AR_STAGE, "hybrid", "single")  # served under these routes
SAMPLED = ("diffusion", AR_STAGE)  # seeded draws: compared within their seeds' spread
METRICS = ("coverage@10", "recall@5k")
SPREADS = 3.0  # a sampled route's tolerance in standard deviations of the per-seed means
FLOOR = 0.005  # and at least this: CPUs differ a little in a sampled route's draws
EXACT = 1e-6  # a deterministic route (no draw) must give the same figure
MARGIN = 0.02  # coverage@10 a learned route must keep over `hybrid`, which chooses nothing
ABOVE_HYBRID = ("diffusion", "ranked")


def shipped_figures(bundle_dir: Path, seeds: int = 4) -> dict[str, Any]:
    """{"split", "seeds", "methods": {method: {metric: {"mean", "per_seed"}}}, "tolerance":
    {metric: bound}}, the reports also written to the bundle's eval/."""
    bundle = load_bundle(Path(bundle_dir), IndexChoice.parse("bundle"))
    encoder = Encoder(bundle.encoder_config)
    methods: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        report = evaluate(bundle, method, SPLIT, encoder=encoder, seeds=seeds)
        per_seed = report["diagnostics"]["per_seed"]
        methods[method] = {m: {"mean": report["metrics"][m], "per_seed": per_seed[m]}
                           for m in METRICS}
        write_report(Path(bundle_dir), report)
    tolerance = {m: max(FLOOR, SPREADS * max(float(np.std(methods[n][m]["per_seed"], ddof=1))
                                             if len(methods[n][m]["per_seed"]) > 1 else 0.0
                                             for n in SAMPLED)) for m in METRICS}
    return {"split": SPLIT, "seeds": seeds, "index": "bundle", "methods": methods,
            "tolerance": tolerance}


def regressions(bundle_dir: Path, figures: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Seed 0 of each checked route on the shipped split: {method: {metric: {"now",
    "shipped", "ok"}}}, where ok means equal for a deterministic route and within the shipped
    tolerance for a sampled one."""
    bundle = load_bundle(Path(bundle_dir), IndexChoice.parse(figures["index"]))
    encoder = Encoder(bundle.encoder_config)
    out: dict[str, dict[str, Any]] = {}
    for method in CHECKED:
        report = evaluate(bundle, method, figures["split"], encoder=encoder, seeds=1)
        out[method] = {}
        for metric in METRICS:
            shipped = figures["methods"][method][metric]["per_seed"][0]
            now = report["metrics"][metric]
            bound = figures["tolerance"][metric] if method in SAMPLED else EXACT
            out[method][metric] = {"now": now, "shipped": shipped,
                                   "ok": abs(now - shipped) <= bound}
    return out


def below_hybrid(measured: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The learned routes whose coverage@10 now is not MARGIN above `hybrid`'s: {route: its
    lead over hybrid}."""
    hybrid = measured["hybrid"]["coverage@10"]["now"]
    leads = {r: measured[r]["coverage@10"]["now"] - hybrid for r in ABOVE_HYBRID}
    return {r: lead for r, lead in leads.items() if lead < MARGIN}
