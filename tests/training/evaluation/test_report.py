"""eval/report.html: every figure drawn from the reports, and the queries that differ most."""

from __future__ import annotations

import base64
import html
import json
import re
import shutil

import numpy as np

from service.artifacts.bundle import load_bundle
from service.fanout.format import item_name
from training.data.splits import load_split
from training.evaluation.harness import evaluate, write_report
from training.evaluation.report import EXAMPLES, example_queries, write_html_report
from training.evaluation.steps_curve import write_steps_curve


def test_the_report_draws_the_figures_and_the_queries_where_methods_differ(
        small_bundle_dir, tmp_path):
    bundle_dir = tmp_path / "b"
    shutil.copytree(small_bundle_dir, bundle_dir, ignore=shutil.ignore_patterns("eval"))
    bundle = load_bundle(bundle_dir)
    reports = {m: evaluate(bundle, m, split="val") for m in ("single", "mmr")}
    for report in reports.values():
        write_report(bundle_dir, report)
    assert reports["mmr"]["metrics"]["reach@10"] is not None  # so the reach figure is drawn

    page = write_html_report(bundle_dir).read_text()

    images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert len(images) == 2  # quality and reach; the steps curve is not computed here
    assert all(base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n" for data in images)
    assert "r4t eval --steps-curve" in page  # says how to get the missing figure
    queries = load_split(bundle_dir, "val")
    coverage = np.array([r["diagnostics"]["per_query"]["coverage@10"] for r in reports.values()])
    most = int(np.argmax(coverage.max(axis=0) - coverage.min(axis=0)))
    assert html.escape(f"“{queries[most].query}”") in page
    for report in reports.values():
        for item in report["diagnostics"]["items"][most]:
            assert html.escape(item_name(bundle.items.texts[bundle.items.row(item)])) in page
    assert page.count("<h3>") == min(EXAMPLES, len(queries))
    assert json.loads((bundle_dir / "eval" / "diagnostics" / "mmr-val.json").read_text())["items"]

    points = [{"solver": "euler", "steps": s, "coverage@10": 0.1 + 0.01 * s,
               "solver_ms_per_query": 0.2 * s} for s in (4, 8, 16)]
    write_steps_curve(bundle_dir, {"split": "val", "n_queries": len(queries), "k": 10,
                                   "seeds": 1, "points": points})
    page = write_html_report(bundle_dir).read_text()
    assert page.count("data:image/png;base64,") == 3 and "r4t eval --steps-curve" not in page


def test_examples_are_the_students_biggest_wins_then_losses():
    coverage = {"single": np.array([0.5, 0.5, 0.5, 0.5, 0.5]),
                "diffusion": np.array([0.6, 0.2, 1.0, 0.5, 0.4]),
                "mmr": np.array([0.0, 1.0, 0.0, 1.0, 0.0])}
    assert example_queries(coverage, 4) == [2, 0, 1, 4]  # +0.5, +0.1, then −0.3, −0.1
    assert example_queries({"single": coverage["single"], "mmr": coverage["mmr"]}, 2) == [0, 1]
