"""reach@10 and the label ceilings of candidate sources."""

from __future__ import annotations

import json

import pytest

from service.artifacts.bundle import load_bundle
from training.data.metrics import best_coverage
from training.evaluation.ceilings import run_ceilings
from training.evaluation.harness import evaluate


def test_best_coverage_picks_the_items_that_reach_most_groups():
    groups = [["a", "b"], ["b", "c"], ["d"]]
    assert best_coverage({"b", "d"}, groups, k=1) == pytest.approx(2 / 3)  # b reaches two
    assert best_coverage({"a", "c", "d"}, groups, k=2) == pytest.approx(2 / 3)
    assert best_coverage({"a", "c", "d"}, groups, k=3) == 1.0
    assert best_coverage(set(), groups) == 0.0


def test_reach_bounds_coverage_and_equals_it_for_single(small_bundle_dir):
    bundle = load_bundle(small_bundle_dir)
    single = evaluate(bundle, "single", "test")["metrics"]
    assert single["reach@10"] == pytest.approx(single["coverage@10"])  # it picks all it has
    for method in ("mmr", "hybrid-names", "mmr-hybrid"):
        metrics = evaluate(bundle, method, "test")["metrics"]
        assert metrics["coverage@10"] <= metrics["reach@10"] + 1e-9


def test_ceilings_report_every_source(small_bundle_dir):
    path = run_ceilings(small_bundle_dir, "test")
    rows = {r["candidates"]: r for r in json.loads(path.read_text())["rows"]}
    assert {"prompt names, dense (16)", "prompt names, hybrid (24)", "dense (16)", "lexical (50)",
            "hybrid (50)"} <= set(rows)
    assert rows["dense (100)"]["ceiling@10"] >= rows["dense (16)"]["ceiling@10"]
    assert path.with_suffix(".md").is_file()
