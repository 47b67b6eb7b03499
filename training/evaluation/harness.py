"""The evaluation harness: run a named method over a benchmark split, write its report.

Reports land in `models/<bundle>/eval/<method>-<split>.json` with the shape
{"method", "split", "n_queries", "k", "metrics": {...}} and a markdown table of every
report so far in `eval/README.md`.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from service.artifacts.bundle import REPORTS_DIR, Bundle, require_stages
from service.artifacts.stages import AR_STAGE, AR_WARMSTART, ONNX_POLICIES
from service.errors import InputError
from service.runtime.encoder import Encoder
from training.data.metrics import (
    best_coverage,
    group_hit_rate,
    hit_at_1,
    ndcg,
    precision,
    recall,
    set_vendi,
    standard_error,
)
from training.data.query_sets import load_queries
from training.data.splits import BenchmarkQuery
from training.evaluation.auto import ar_led, auto, auto_ar, diffusion_led
from training.evaluation.baselines import BASELINES, Method, MethodOutput
from training.evaluation.context_scorer import context_scorer
from training.evaluation.diffusion_method import diffusion
from training.evaluation.fanout import FANOUT_METHODS
from training.evaluation.llm import LLM_METHODS
from training.evaluation.student_scores import diffusion_scores
from training.stage1_fanout.reward import score_probes

METRICS = (
    "recall@5k", "hit@5k", "precision@10", "coverage@10", "hit@1", "ndcg@10", "reach@10",
    "vendi@10", "alignment", "groundedness", "reward", "latency_ms_per_query",
)
BATCH = 64
# per-query extras, averaged into the report's "diagnostics": the paper's literal Recall@5K
# (the union of 500 per probe, fewer distinct items when probes overlap) and both pool sizes
DIAGNOSTICS = ("distinct_subqueries", "recall@5k_union", "pool_size", "union_pool_size")

# name -> factory(bundle, k, **options) -> Method; later stages register their methods here.
METHODS: dict[str, Callable[..., Method]] = {**BASELINES, **FANOUT_METHODS, **LLM_METHODS,
                                             "diffusion": diffusion, "auto": auto,
                                             "auto-ar": auto_ar, "diffusion-led": diffusion_led,
                                             "ar-led": ar_led, "context-scorer": context_scorer,
                                             "diffusion-scores": diffusion_scores}
# diagnostics that read a training run (a stage-2 dataset, a stage-3 checkpoint), which a
# bundle built from the shipped stages lacks: `--method all` leaves them out
DIAGNOSTIC_METHODS = ("context-scorer", "diffusion-scores")
_PROMPTED = "lexical"  # the prompts' and the student's candidates are hybrid: they read it
# the bundle stages each method reads besides the catalog (and the split's benchmark)
METHOD_STAGES: dict[str, tuple[str | tuple[str, ...], ...]] = {
    **dict.fromkeys(("single", "mmr", "reward-greedy", "prompt-names"), ()),
    **dict.fromkeys(("hybrid", "hybrid-names", "mmr-hybrid"), (_PROMPTED,)),
    **dict.fromkeys((AR_WARMSTART, "best-of-5"), (_PROMPTED, AR_WARMSTART)),
    AR_STAGE: (_PROMPTED, AR_STAGE),
    "ranked": (_PROMPTED, "ranker"),
    "context-scorer": (),  # it reads a stage-2 run (the bundle's, or its `dataset`)
    **dict.fromkeys(LLM_METHODS, (_PROMPTED, "llm")),
    **dict.fromkeys(("diffusion", "auto", "diffusion-led", "diffusion-scores"),
                    (_PROMPTED, "diffusion")),
    **dict.fromkeys(("auto-ar", "ar-led"), (_PROMPTED, ONNX_POLICIES)),
}
PER_SEED = ("recall@5k", "coverage@10", "reward")  # per-seed means kept in the diagnostics
PAIRED = ("coverage@10", "recall@5k")  # per-query means compared in the paired tables
PER_QUERY = (*PAIRED, "precision@10", "hit@1", "ndcg@10")  # per-query means kept
DIAGNOSTICS_DIR = "diagnostics"  # per-report extras kept apart so reports keep their exact shape


def require_methods(bundle_dir: Path, methods: list[str], split: str,
                    manifest: dict[str, Any] | None = None) -> None:
    """A BundleError naming the first stage one of `methods` needs on `split` that the bundle
    lacks, and its command; an InputError for an unknown method."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise InputError(f"unknown method {unknown[0]!r}; available: {sorted(METHODS)}")
    for method in methods:
        benchmark = () if split.startswith("narrow-") else ("benchmark",)
        require_stages(bundle_dir, ("catalog", *benchmark, *METHOD_STAGES[method]),
                       f"r4t eval --method {method}", manifest)


def query_metrics(query: BenchmarkQuery, out: MethodOutput, i: int, bundle: Bundle) -> dict:
    """Reference-based metrics of query i (NaN when the query has no reference groups)."""
    ids = bundle.items.ids
    returned = [ids[r] for r in out.items[i]]
    pool = {ids[r] for r in out.pools[i]}
    reference = query.reference
    union = {ids[r] for r in out.union_pools[i]} if out.union_pools is not None else pool
    return {
        "recall@5k_union": recall(union, reference),
        "pool_size": float(len(pool)),
        "union_pool_size": float(len(union)),
        "recall@5k": recall(pool, reference),
        "hit@5k": group_hit_rate(pool, query.groups),
        "items": returned,
        "precision@10": precision(returned, reference),
        "coverage@10": group_hit_rate(set(returned), query.groups),
        "hit@1": hit_at_1(returned, query.target),
        "ndcg@10": ndcg(returned, reference),
        "vendi@10": set_vendi(bundle.items.embeddings[out.items[i]]),
        "reach@10": float("nan") if out.candidates is None else
        best_coverage({ids[r] for r in out.candidates[i]}, query.groups),
    }


def evaluate(
    bundle: Bundle,
    method: str,
    split: str = "test",
    k: int = 10,
    limit: int | None = None,
    encoder: Encoder | None = None,
    seeds: int = 1,
    **options: Any,
) -> dict[str, Any]:
    """Run `method` over `split` in batches and return the report dict. A sampling method
    (one taking a `seed`) runs with seeds s..s+seeds−1 (s = options' `seed`, else 0) and its
    metrics average over every (query, seed) pair; the per-seed means go to the diagnostics."""
    require_methods(bundle.path, [method], split, bundle.manifest)
    if seeds < 1:
        raise InputError(f"seeds must be at least 1, got {seeds}")
    queries = load_queries(bundle.path, split)[:limit]
    encoder = encoder or Encoder(bundle.encoder_config)
    seeded = "seed" in inspect.signature(METHODS[method]).parameters
    first = options.pop("seed", 0) if seeded else 0
    runs: list[list[dict]] = []
    elapsed = cpu = 0.0
    for seed in range(first, first + (seeds if seeded else 1)):
        run = METHODS[method](bundle, k=k, **({"seed": seed} if seeded else {}), **options)
        rows, seconds, cpu_seconds = _score(bundle, run, queries, encoder,
                                            f"eval {method}/{split}")
        runs.append(rows)
        elapsed += seconds
        cpu += cpu_seconds
    rows = [row for seed_rows in runs for row in seed_rows]
    metrics = {name: _mean([r[name] for r in rows]) for name in METRICS[:-1]}
    metrics["latency_ms_per_query"] = 1000.0 * elapsed / max(len(rows), 1)
    diagnostics: dict[str, Any] = {name: _mean([r[name] for r in rows]) for name in DIAGNOSTICS}
    diagnostics["seeds"] = len(runs)
    diagnostics["cpu_ms_per_query"] = 1000.0 * cpu / max(len(rows), 1)
    diagnostics["per_seed"] = {name: [_mean([r[name] for r in seed_rows]) for seed_rows in runs]
                               for name in PER_SEED}
    diagnostics["per_query"] = {name: [_mean([seed_rows[i][name] for seed_rows in runs])
                                       for i in range(len(queries))] for name in PER_QUERY}
    diagnostics["items"] = [row["items"] for row in runs[0]]  # the first seed's, per query
    return {"method": method, "split": split, "n_queries": len(queries), "k": k,
            "metrics": metrics, "diagnostics": diagnostics}


def _score(bundle: Bundle, run: Method, queries: list[BenchmarkQuery], encoder: Encoder,
           desc: str) -> tuple[list[dict], float, float]:
    """Per-query metric rows of one pass of `run` over `queries`, its seconds and this
    process's CPU seconds (what other processes on the machine do not inflate)."""
    rows: list[dict] = []
    elapsed = cpu = 0.0
    for start in tqdm(range(0, len(queries), BATCH), desc=desc, unit="batch"):
        batch = queries[start : start + BATCH]
        texts = [q.query for q in batch]
        began, began_cpu = time.perf_counter(), time.process_time()
        embedded = encoder.encode(texts)  # (B, d)
        out = run(texts, embedded)
        elapsed += time.perf_counter() - began
        cpu += time.process_time() - began_cpu
        terms = score_probes(bundle.index, bundle.items.embeddings, embedded, out.probes, out.valid)
        for i, query in enumerate(batch):
            row = query_metrics(query, out, i, bundle)
            row.update(alignment=terms.alignment[i], groundedness=terms.ground[i])
            row["reward"] = terms.total[i]
            row["distinct_subqueries"] = float(terms.n_valid[i])
            rows.append(row)
    return rows, elapsed, cpu


def _mean(values: list[float]) -> float | None:
    array = np.asarray(values, dtype=np.float64)
    return float(np.nanmean(array)) if np.isfinite(array).any() else None


def write_report(bundle_dir: Path, report: dict[str, Any]) -> Path:
    """Write the report JSON and refresh the markdown table of all reports."""
    directory = bundle_dir / REPORTS_DIR
    (directory / DIAGNOSTICS_DIR).mkdir(parents=True, exist_ok=True)
    report = dict(report)
    name = f"{report['method']}-{report['split']}.json"
    diagnostics = report.pop("diagnostics", {})
    (directory / DIAGNOSTICS_DIR / name).write_text(json.dumps(diagnostics, indent=2) + "\n")
    path = directory / name
    path.write_text(json.dumps(report, indent=2) + "\n")
    (directory / "README.md").write_text(results_table(bundle_dir))
    return path


def results_table(bundle_dir: Path) -> str:
    """Markdown table of every report in the bundle's eval folder."""
    reports = [json.loads(p.read_text()) for p in sorted((bundle_dir / REPORTS_DIR).glob("*.json"))]
    header = "| method | split | n | " + " | ".join(METRICS) + " | distinct sub-queries |"
    lines = [f"# Evaluation of bundle `{bundle_dir.name}`", "", header,
             "|" + "---|" * (len(METRICS) + 4)]
    for r in sorted(reports, key=lambda r: (r["split"], r["method"])):
        extra = bundle_dir / REPORTS_DIR / DIAGNOSTICS_DIR / f"{r['method']}-{r['split']}.json"
        distinct = json.loads(extra.read_text()) if extra.is_file() else {}
        cells = [_fmt(r["metrics"].get(name)) for name in METRICS]
        cells.append(_fmt(distinct.get("distinct_subqueries")))
        head = f"| {r['method']} | {r['split']} | {r['n_queries']} | "
        lines.append(head + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def per_query_means(bundle_dir: Path, split: str) -> dict[str, dict[str, list[float]]]:
    """method → metric → its per-query means on `split`, from the reports' diagnostics."""
    directory = bundle_dir / REPORTS_DIR
    out = {}
    for path in sorted(directory.glob("*.json")):
        report = json.loads(path.read_text())
        extra = directory / DIAGNOSTICS_DIR / path.name
        if report.get("split") == split and extra.is_file():
            out[report["method"]] = json.loads(extra.read_text()).get("per_query") or {}
    return out


def query_kinds(bundle_dir: Path, split: str) -> list[str]:
    """Each query's kind, the part of its id before ":" (a user's benchmark may name kinds so,
    as ICD-10's `category:A00` does); "" where its id has none."""
    return [q.id.split(":")[0] if ":" in q.id else "" for q in load_queries(bundle_dir, split)]


def paired_table(bundle_dir: Path, split: str, reference: str = "diffusion",
                 kind: str | None = None) -> str:
    """Markdown: `reference` minus each other method on `split` (its queries of `kind` when
    given), paired over queries (mean difference ± its standard error), from the reports'
    per-query means; the columns are the PER_QUERY metrics the split defines (hit@1 only where
    queries name an item)."""
    per_query = per_query_means(bundle_dir, split)
    if kind is not None:
        chosen = np.asarray(query_kinds(bundle_dir, split)) == kind
        per_query = {method: {m: np.asarray(v, dtype=float)[chosen[:len(v)]]  # a --limit run
                              for m, v in metrics.items()}
                     for method, metrics in per_query.items()}
    base = per_query.get(reference)
    if not base:
        return ""
    names = [m for m in PER_QUERY if m in base and np.isfinite(np.asarray(base[m], float)).any()
             and (m in PAIRED or "-" in split)]
    subset = "" if kind is None else f" ({kind or 'no kind'}: {int(chosen.sum())} queries)"
    lines = [f"## {reference} minus each method on {split}{subset}, paired over queries", "",
             "| method | " + " | ".join(f"Δ {m} ± se" for m in names) + " |",
             "|---|" + "---:|" * len(names)]
    for method, other in per_query.items():
        if method == reference or not all(m in other for m in names):
            continue
        cells = []
        for name in names:
            diff = np.asarray(base[name], dtype=float) - np.asarray(other[name], dtype=float)
            diff = diff[np.isfinite(diff)]
            cells.append(f"{diff.mean():+.3f} ± {standard_error(diff):.3f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3f}"


def gaps(bundle_dir: Path, split: str = "test") -> dict[str, Any]:
    """Relative gaps from the harness's reports: train vs `split`, and teacher (folm) vs student."""
    def metrics(method: str, on: str) -> dict[str, float] | None:
        path = bundle_dir / REPORTS_DIR / f"{method}-{on}.json"
        return json.loads(path.read_text())["metrics"] if path.is_file() else None

    student, train, teacher = metrics("diffusion", split), metrics("diffusion", "train"), \
        metrics(AR_STAGE, split)
    out: dict[str, Any] = {}
    for name in ("coverage@10", "recall@5k", "groundedness", "vendi@10"):
        if student and train and train.get(name):
            out.setdefault("train_vs_" + split, {})[name] = 1 - student[name] / train[name]
        if student and teacher and teacher.get(name):
            out.setdefault("student_vs_teacher", {})[name] = 1 - student[name] / teacher[name]
    return out
