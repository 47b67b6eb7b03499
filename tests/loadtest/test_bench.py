"""The speed benchmark: its trigger measurement on the small real bundle (no stages 1-3), and
how a batch's stage clocks become a row."""

from __future__ import annotations

import json

import pytest

from loadtest.bench import _row, run_trigger


def test_the_trigger_is_timed_beside_single_in_one_run(small_bundle_dir, tmp_path):
    report = run_trigger(small_bundle_dir, (8, 16), tmp_path)
    assert [r["batch"] for r in report["rows"]] == [8, 16]
    for row in report["rows"]:
        assert row["single_s"] > 0 and row["trigger_s"] > 0
        assert row["trigger_vs_single"] == row["trigger_s"] / row["single_s"]
    assert json.loads((tmp_path / "bench-trigger.json").read_text()) == report
    assert "| 16 |" in (tmp_path / "bench-trigger.md").read_text()


def test_a_row_puts_the_ranked_route_beside_single_when_the_bundle_has_a_ranker():
    clocks = {"diffusion": {"encode": 0.1, "context": 0.5, "solver": 0.2, "search": 0.2},
              "ar": {"decode": 3.0, "encode": 0.5, "search": 0.5, "tokens": 400},
              "single": {"encode": 0.1, "search": 0.1},
              "trigger": {"decide": 0.01}}
    config = {"flops_per_query": 1e6}
    without = _row(8, clocks, config, peak=100.0)
    assert without["ranked_s"] is None and without["ranked_vs_single"] is None
    row = _row(8, clocks | {"ranked": {"encode": 0.1, "rank": 0.6, "search": 0.1}}, config,
               peak=100.0)
    assert row["ranked_s"] == pytest.approx(0.8)
    assert row["ranked_vs_single"] == pytest.approx(4.0)
    assert row["speedup"] == pytest.approx(4.0)  # AR's 4 s over diffusion's 1 s: tokens no time
