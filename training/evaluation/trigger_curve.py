"""The curve the fan-out trigger's threshold is chosen from (`r4t eval --trigger-curve`).

It reads the per-query metrics of `single` and of the fan-out method on a split (their
reports) and the trigger's score of every query, and tabulates, per threshold, the share of
queries fanned out and what fanning them out gains and harms (the mean over all queries of the
positive and of the negative per-query differences, apart) on each metric.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from service.artifacts.bundle import REPORTS_DIR
from service.artifacts.lexical import LEXICAL_FILE, LexicalIndex
from service.errors import InputError
from service.scheduling.trigger import FanoutTrigger
from service.settings import Settings
from training.data.query_sets import load_queries
from training.evaluation.harness import per_query_means

CURVE_DIR = "trigger_curve"  # under eval/: the harness's table only reads eval/*.json
CURVE_METRICS = ("coverage@10", "ndcg@10", "hit@1", "precision@10")
# the threshold's objective: a metric every query has, rewarding a broad query's relevant items
# and a narrow one's item ranked first (coverage@10 of a narrow query is recall@10 of its kin)
OBJECTIVE = "ndcg@10"


def trigger_curve(bundle_dir: Path, split: str, fanout: str = "diffusion") -> dict[str, Any]:
    """Per threshold: share fanned out, and the gains and harms of fanning out, per metric."""
    means = per_query_means(bundle_dir, split)
    missing = [m for m in ("single", fanout) if m not in means]
    if missing:
        raise InputError(f"the trigger curve on {split} needs the reports of {missing}: run "
                         f"`r4t eval --method single,{fanout} --split {split}` first")
    path = bundle_dir / LEXICAL_FILE  # the trigger reads this alone: no bundle load needed
    trigger = FanoutTrigger(LexicalIndex(path) if path.is_file() else None,
                            Settings().fanout_threshold)
    scores = np.array([trigger.score(q.query) or 0.0 for q in load_queries(bundle_dir, split)])
    delta = {m: np.asarray(means[fanout][m], float) - np.asarray(means["single"][m], float)
             for m in CURVE_METRICS}
    points = [curve_point(scores, delta, t)
              for t in [*np.unique(scores).tolist(), float(scores.max()) + 1.0]]
    best = max(points, key=lambda p: (p[OBJECTIVE]["net"], p["threshold"]))
    return {"split": split, "fanout": fanout, "n_queries": len(scores), "objective": OBJECTIVE,
            "served_threshold": trigger.threshold, "best_threshold": best["threshold"],
            "served": curve_point(scores, delta, trigger.threshold), "points": points}


def curve_point(scores: np.ndarray, delta: dict[str, np.ndarray],
                threshold: float) -> dict[str, Any]:
    """Fanning out the queries scoring ≥ threshold: per metric, the mean gain, harm and net
    over all queries (a query without the metric, e.g. hit@1 of a broad one, counts 0)."""
    wide = scores >= threshold
    point: dict[str, Any] = {"threshold": threshold, "share_fanned_out": float(wide.mean())}
    for name, d in delta.items():
        d = np.where(wide & np.isfinite(d), d, 0.0)
        point[name] = {"gain": float(np.clip(d, 0, None).mean()),
                       "harm": float(np.clip(d, None, 0).mean()), "net": float(d.mean())}
    return point


def write_trigger_curve(bundle_dir: Path, curve: dict[str, Any]) -> Path:
    directory = bundle_dir / REPORTS_DIR / CURVE_DIR
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{curve['fanout']}-{curve['split']}"
    (directory / f"{stem}.json").write_text(json.dumps(curve, indent=2) + "\n")
    path = directory / f"{stem}.md"
    path.write_text(curve_table(curve))
    return path


def curve_table(curve: dict[str, Any]) -> str:
    """Markdown: a row per distinct share fanned out (every 5%), gains and harms apart."""
    head = "| threshold | fanned out | " + " | ".join(
        f"{m} gain / harm / net" for m in CURVE_METRICS) + " |"
    lines = [f"# Fan-out trigger on `{curve['split']}`: {curve['fanout']} vs single", "",
             f"Best threshold by net {curve['objective']}: {curve['best_threshold']:.3f}; "
             f"served: {curve['served_threshold']:.3f} (fans out "
             f"{curve['served']['share_fanned_out']:.1%}).", "", head,
             "|---:|---:|" + "---:|" * len(CURVE_METRICS)]
    shown: set[int] = set()
    for p in curve["points"]:
        bucket = round(p["share_fanned_out"] * 20)
        if bucket in shown and p["threshold"] != curve["best_threshold"]:
            continue
        shown.add(bucket)
        cells = [f"{p[m]['gain']:+.3f} / {p[m]['harm']:+.3f} / {p[m]['net']:+.3f}"
                 for m in CURVE_METRICS]
        lines.append(f"| {p['threshold']:.3f} | {p['share_fanned_out']:.1%} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_trigger_curve(bundle_dir: Path, split: str, fanout: str = "diffusion") -> None:
    path = write_trigger_curve(bundle_dir, trigger_curve(bundle_dir, split, fanout))
    print(path.read_text())
    print(f"wrote {path}")
