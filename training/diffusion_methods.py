"""The diffusion retriever in the evaluation harness: method `diffusion`, the steps curve, gaps.

`diffusion(bundle, k, steps=None)` runs the bundle's exported sampler (`diffusion/sampler.onnx`)
through `service.sampler.DiffusionSampler` as the service does (its context looked up by
`service.paths.DiffusionContext`, its draws by `service.paths.draw_rows`) and resolves the
generated rows to k distinct items (`distinct_nearest`; with L > k rows the k most confident
resolutions are kept). The generated
rows are the probes, so the harness scores their content-side groundedness. With `steps` (or
`solver`) given, a sampler with that schedule is composed from the bundle's `step.onnx`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from service.bundle import REPORTS_DIR, Bundle
from service.encoder import Encoder
from service.paths import DiffusionContext, draw_rows, repeat_draws
from service.resolution import distinct_nearest
from service.sampler import CONFIG_FILE, SAMPLER_FILE, STEP_FILE, DiffusionSampler, read_config
from training.methods import Method, MethodOutput, fanout_output

STEPS_CURVE = (4, 8, 16, 32, 64, 256)
CURVE_DIR = "steps_curve"  # under eval/: the harness's table only reads eval/*.json
BENCH_BATCH = 64


def composed_sampler_dir(diffusion_dir: Path, solver: str, steps: int, form: str) -> Path:
    """A temporary folder holding a sampler with another schedule, composed from step.onnx."""
    from training.diffusion_export import compose_sampler, sampler_evaluations_flops

    config = read_config(diffusion_dir)
    step = onnx.load(str(diffusion_dir / STEP_FILE))
    graph = compose_sampler(step, config["rows"], config["dim"], solver, steps,
                            config["sigma_min"], config["sigma_max"], form)
    out = Path(tempfile.mkdtemp(prefix="r4t-sampler-"))
    onnx.save(graph, str(out / SAMPLER_FILE))
    nfe, flops = sampler_evaluations_flops(config, solver, steps)
    config.update(solver=solver, steps=steps, form=form, evaluations=nfe,
                  flops_per_query=flops, sampler_file=SAMPLER_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def open_sampler(bundle: Bundle, steps: int | None = None, solver: str | None = None,
                 threads: int = 0) -> DiffusionSampler:
    diffusion_dir = bundle.path / "diffusion"
    config = read_config(diffusion_dir)
    if (steps is None or steps == config["steps"]) and solver in (None, config["solver"]):
        return DiffusionSampler(diffusion_dir, threads=threads)
    # A 256-step sampler as a Loop keeps the graph small; few steps unroll.
    steps = steps or int(config["steps"])
    form = "loop" if steps > 32 else "unrolled"
    temp = composed_sampler_dir(diffusion_dir, solver or config["solver"], steps, form)
    try:
        return DiffusionSampler(temp, threads=threads)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def keep_confident(rows: np.ndarray, items: np.ndarray, scores: np.ndarray,
                   k: int) -> tuple[np.ndarray, np.ndarray]:
    """With L > k rows, keep the k whose items resolved with the highest cosine."""
    if rows.shape[1] == k:
        return rows, items
    order = np.sort(np.argsort(-scores, axis=1, kind="stable")[:, :k], axis=1)  # (Q, k)
    return np.take_along_axis(rows, order[..., None], 1), np.take_along_axis(items, order, 1)


def diffusion(bundle: Bundle, k: int = 10, steps: int | None = None, solver: str | None = None,
              seed: int = 0, threads: int = 0) -> Method:
    """Eval factory: generated rows (the probes) → k distinct nearest items; the rows share
    one 5,000-item pool."""
    sampler = open_sampler(bundle, steps, solver, threads)
    lookup = DiffusionContext(bundle, sampler.config)

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        context = lookup(texts, queries)  # (Q, C, d) or None
        rows = draw_rows(bundle.index, sampler, queries, seed, context)  # (Q, L, d)
        items, scores = distinct_nearest(bundle.index, rows)  # (Q, L) each
        probes, items = keep_confident(rows, items, scores, k)  # (Q, k, d), (Q, k)
        return fanout_output(bundle, probes, items)

    return run


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
                solvers: tuple[str, ...] = ("euler", "heun"), k: int = 10,
                limit: int | None = None, encoder: Encoder | None = None,
                seeds: int = 1) -> dict[str, Any]:
    """Quality (averaged over `seeds` noise seeds) and ms/query for each (solver, steps),
    relative to 256-step Euler (the paper's)."""
    from training.benchmark import load_split
    from training.evaluation import METHODS, evaluate

    METHODS.setdefault("diffusion", diffusion)
    encoder = encoder or Encoder(bundle.encoder_config)
    texts = [q.query for q in load_split(bundle.path, split)[:limit]]
    embedded = encoder.encode(texts)  # (Q, d)
    # every composed sampler shares the exported model's context: look it up once
    context = DiffusionContext(bundle, read_config(bundle.path / "diffusion"))(texts, embedded)
    points = []
    for solver in solvers:
        for steps in steps_list:
            report = evaluate(bundle, "diffusion", split, k, limit, encoder, seeds=seeds,
                              steps=steps, solver=solver)
            sampler = open_sampler(bundle, steps, solver)
            bench = solver_benchmark(sampler, embedded, repeats=1, context=context)
            points.append({"solver": solver, "steps": steps,
                           "evaluations": sampler.config["evaluations"],
                           "mflop_per_query": sampler.config["flops_per_query"] / 1e6,
                           "solver_ms_per_query": bench["ms_per_query"],
                           **report["metrics"]})
    reference = next((p for p in points if p["solver"] == "euler" and p["steps"] == 256), None)
    for point in points:
        if reference and reference["coverage@10"]:
            point["coverage_vs_euler256"] = point["coverage@10"] / reference["coverage@10"]
    exported = read_config(bundle.path / "diffusion")
    return {"split": split, "n_queries": len(embedded), "k": k, "seeds": seeds, "points": points,
            "exported": {key: exported.get(key) for key in ("solver", "steps", "cfg_weight",
                                                             "draws", "context_source")}}


def write_steps_curve(bundle_dir: Path, curve: dict[str, Any]) -> Path:
    """eval/steps_curve/<split>.json and a markdown table next to it."""
    directory = bundle_dir / REPORTS_DIR / CURVE_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{curve['split']}.json"
    path.write_text(json.dumps(curve, indent=2) + "\n")
    columns = ("solver", "steps", "evaluations", "mflop_per_query", "solver_ms_per_query",
               "coverage@10", "recall@5k", "groundedness", "coverage_vs_euler256")
    seeds = curve.get("seeds", 1)
    lines = [f"# Steps curve ({curve['split']}, {curve['n_queries']} queries, {seeds} seeds)", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for point in curve["points"]:
        cells = [_cell(point.get(c)) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return path


def gaps(bundle_dir: Path, split: str = "test") -> dict[str, Any]:
    """Relative gaps from the harness's reports: train vs `split`, and teacher (folm) vs student."""
    def metrics(method: str, on: str) -> dict[str, float] | None:
        path = bundle_dir / REPORTS_DIR / f"{method}-{on}.json"
        return json.loads(path.read_text())["metrics"] if path.is_file() else None

    student, train, teacher = metrics("diffusion", split), metrics("diffusion", "train"), \
        metrics("folm", split)
    out: dict[str, Any] = {}
    for name in ("coverage@10", "recall@5k", "groundedness", "vendi@10"):
        if student and train and train.get(name):
            out.setdefault("train_vs_" + split, {})[name] = 1 - student[name] / train[name]
        if student and teacher and teacher.get(name):
            out.setdefault("student_vs_teacher", {})[name] = 1 - student[name] / teacher[name]
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return "–" if value is None else str(value)


def run_steps_curve(bundle_dir: Path, split: str = "test", k: int = 10,
                    limit: int | None = None, seeds: int = 1) -> Path:
    """`r4t eval --steps-curve`: compute, write and print the curve; returns the JSON path."""
    from service.bundle import load_bundle

    curve = steps_curve(load_bundle(bundle_dir), split, k=k, limit=limit, seeds=seeds)
    path = write_steps_curve(bundle_dir, curve)
    print(path.with_suffix(".md").read_text())
    return path


def benchmark_sampler(diffusion_dir: Path, batch: int = BENCH_BATCH, n_queries: int = 512,
                      threads: int = 0, seed: int = 0) -> dict[str, Any]:
    """Solver-only throughput of an exported sampler on random unit queries (and random unit
    context rows when it has a context; the values do not change the cost). Run it alone."""
    sampler = DiffusionSampler(diffusion_dir, threads=threads)
    rng = np.random.default_rng(seed)
    queries = rng.standard_normal((n_queries, sampler.dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    context = None
    if sampler.context:
        context = rng.standard_normal((n_queries, sampler.context, sampler.dim)).astype(np.float32)
        context /= np.linalg.norm(context, axis=2, keepdims=True)
    result = solver_benchmark(sampler, queries, batch, context=context)
    return {**result, "threads": threads, "providers": sampler.providers,
            **{key: sampler.config[key] for key in ("solver", "steps", "cfg_weight", "form",
                                                    "flops_per_query")},
            "context": sampler.context}
