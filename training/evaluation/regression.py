"""The figures shipped stages are shipped with, and the check that a bundle still reaches them.

`r4t ship` measures each route on the val split over several seeds (the exact index, the
harness's own path objects); the test suite re-runs seed 0 on a bundle that adopted the
shipped stages and fails when a figure moves by more than the tolerance: a multiple of the
seeds' spread, so that a change which silently degrades the shipped model fails CI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from service.artifacts.bundle import load_bundle
from service.runtime.encoder import Encoder
from service.runtime.index import IndexChoice
from training.evaluation.harness import evaluate, write_report

SPLIT = "val"
METHODS = ("diffusion", "folm", "single", "hybrid-names")  # the routes, and the prompt order
CHECKED = ("diffusion", "folm", "single")  # served as `diffusion`, `ar`, `single`
METRICS = ("coverage@10", "recall@5k")
SPREADS = 3.0  # the tolerance in standard deviations of the per-seed means
FLOOR = 0.005  # and at least this: deterministic routes have no spread, CPUs differ a little


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
                                             for n in METHODS)) for m in METRICS}
    return {"split": SPLIT, "seeds": seeds, "index": "bundle", "methods": methods,
            "tolerance": tolerance}


def regressions(bundle_dir: Path, figures: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Seed 0 of each checked route on the shipped split: {method: {metric: {"now",
    "shipped", "ok"}}}, where ok means within the shipped tolerance."""
    bundle = load_bundle(Path(bundle_dir), IndexChoice.parse(figures["index"]))
    encoder = Encoder(bundle.encoder_config)
    out: dict[str, dict[str, Any]] = {}
    for method in CHECKED:
        report = evaluate(bundle, method, figures["split"], encoder=encoder, seeds=1)
        out[method] = {}
        for metric in METRICS:
            shipped = figures["methods"][method][metric]["per_seed"][0]
            now = report["metrics"][metric]
            out[method][metric] = {"now": now, "shipped": shipped,
                                   "ok": abs(now - shipped) <= figures["tolerance"][metric]}
    return out
