"""The speed benchmark's trigger measurement on the small real bundle (no stages 1-3)."""

from __future__ import annotations

import json

from loadtest.bench import run_trigger


def test_the_trigger_is_timed_beside_single_in_one_run(small_bundle_dir, tmp_path):
    report = run_trigger(small_bundle_dir, (8, 16), tmp_path)
    assert [r["batch"] for r in report["rows"]] == [8, 16]
    for row in report["rows"]:
        assert row["single_s"] > 0 and row["trigger_s"] > 0
        assert row["trigger_vs_single"] == row["trigger_s"] / row["single_s"]
    assert json.loads((tmp_path / "bench-trigger.json").read_text()) == report
    assert "| 16 |" in (tmp_path / "bench-trigger.md").read_text()
