"""The steps curve: diffusion quality and solver cost at each solver and step count, relative
to 256-step Euler (the paper's schedule), written beside the evaluation reports."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from service.artifacts.bundle import REPORTS_DIR, Bundle, load_bundle
from service.routes.diffusion import DiffusionContext, repeat_draws
from service.runtime.encoder import Encoder
from service.runtime.sampler import DiffusionSampler, read_config
from training.data.splits import load_split
from training.evaluation.diffusion_method import open_sampler
from training.evaluation.harness import evaluate
from training.stage3_diffusion.command import SOLVER_NAMES

STEPS_CURVE = (1, 2, 4, 8, 16, 32, 64, 256)
DRAWS_CURVE = (1, 2)  # blocks per query, measured at the few-step end
FEW_STEPS = 4
CURVE_DIR = "steps_curve"  # under eval/: the harness's table only reads eval/*.json
BENCH_BATCH = 64


def solver_benchmark(sampler: DiffusionSampler, queries: np.ndarray, batch: int = BENCH_BATCH,
                     repeats: int = 3, context: np.ndarray | None = None) -> dict[str, float]:
    """Solver-only throughput: best of `repeats` passes over `queries` in batches of `batch`
    (the context, when the sampler has one, is looked up beforehand: it is a search)."""
    draws = int(sampler.config.get("draws", 1))  # as served: the batch repeated per draw

    def run(start: int) -> np.ndarray:
        part = None if context is None else context[start : start + batch]
        repeated, repeated_context = repeat_draws(queries[start : start + batch], part, draws)
        return sampler.sample(repeated, seed=0, context=repeated_context)

    run(0)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for start in range(0, len(queries), batch):
            run(start)
        best = min(best, time.perf_counter() - began)
    return {"ms_per_query": 1000.0 * best / len(queries), "queries_per_s": len(queries) / best,
            "batch": batch}


def steps_curve(bundle: Bundle, split: str = "test", steps_list: tuple[int, ...] = STEPS_CURVE,
                solvers: tuple[str, ...] = SOLVER_NAMES, k: int = 10,
                limit: int | None = None, encoder: Encoder | None = None,
                seeds: int = 1) -> dict[str, Any]:
    """Quality (averaged over `seeds` noise seeds) and ms/query for each (solver, steps),
    relative to 256-step Euler (the paper's)."""
    encoder = encoder or Encoder(bundle.encoder_config)
    texts = [q.query for q in load_split(bundle.path, split)[:limit]]
    embedded = encoder.encode(texts)  # (Q, d)
    exported = read_config(bundle.path / "diffusion")
    # every composed sampler shares the exported model's context: look it up once
    context = DiffusionContext(bundle, exported)(texts, embedded)
    points = []
    exported_draws = int(exported.get("draws", 1))
    for solver in solvers:
        for steps in steps_list:
            for draws in DRAWS_CURVE if steps <= FEW_STEPS else (exported_draws,):
                report = evaluate(bundle, "diffusion", split, k, limit, encoder, seeds=seeds,
                                  steps=steps, solver=solver, draws=draws)
                sampler = open_sampler(bundle, steps, solver)
                sampler.config["draws"] = draws
                bench = solver_benchmark(sampler, embedded, repeats=1, context=context)
                points.append({"solver": solver, "steps": steps, "draws": draws,
                               "evaluations": sampler.config["evaluations"] * draws,
                               "mflop_per_query": draws * sampler.config["flops_per_query"]
                               / 1e6 / exported_draws,
                               "solver_ms_per_query": bench["ms_per_query"],
                               **report["metrics"]})
    reference = next((p for p in points if p["solver"] == "euler" and p["steps"] == 256), None)
    for point in points:
        if reference and reference["coverage@10"]:
            point["coverage_vs_euler256"] = point["coverage@10"] / reference["coverage@10"]
    return {"split": split, "n_queries": len(embedded), "k": k, "seeds": seeds, "points": points,
            "exported": {key: exported.get(key) for key in ("solver", "steps", "cfg_weight",
                                                             "draws", "context_source")}}


def write_steps_curve(bundle_dir: Path, curve: dict[str, Any]) -> Path:
    """eval/steps_curve/<split>.json and a markdown table next to it."""
    directory = bundle_dir / REPORTS_DIR / CURVE_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{curve['split']}.json"
    path.write_text(json.dumps(curve, indent=2) + "\n")
    columns = ("solver", "steps", "draws", "evaluations", "mflop_per_query", "solver_ms_per_query",
               "coverage@10", "recall@5k", "groundedness", "coverage_vs_euler256")
    seeds = curve.get("seeds", 1)
    lines = [f"# Steps curve ({curve['split']}, {curve['n_queries']} queries, {seeds} seeds)", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for point in curve["points"]:
        cells = [_cell(point.get(c)) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return path


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return "–" if value is None else str(value)


def run_steps_curve(bundle_dir: Path, split: str = "test", k: int = 10,
                    limit: int | None = None, seeds: int = 1) -> Path:
    """`r4t eval --steps-curve`: compute, write and print the curve; returns the JSON path."""
    curve = steps_curve(load_bundle(bundle_dir), split, k=k, limit=limit, seeds=seeds)
    path = write_steps_curve(bundle_dir, curve)
    print(path.with_suffix(".md").read_text())
    return path
