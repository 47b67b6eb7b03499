"""`r4t frontier`: each route the bundle has, its coverage on both splits and its CPU per answer
relative to single's, written as JSON, markdown and a picture."""

from __future__ import annotations

import json

from training.evaluation.frontier import points, run_frontier


def test_the_frontier_measures_every_route_the_bundle_has(small_bundle_dir, tmp_path):
    assert [p.label for p in points(small_bundle_dir, [])] == ["single", "hybrid", "ranked"]
    report = run_frontier(small_bundle_dir, [], tmp_path)
    rows = {row["label"]: row for row in report["rows"]}
    assert set(rows) == {"single", "hybrid", "ranked"}
    for row in rows.values():
        assert 0.0 <= row["val_coverage@10"] <= 1.0 and row["cpu_ms_per_answer"] > 0
        assert len(row["test_per_query"]) > 0
    assert json.loads((tmp_path / "frontier.json").read_text())["rows"][0]["label"] == "single"
    text = (tmp_path / "frontier.md").read_text()
    assert "| single |" in text and "| ranked |" in text and "1.0× |" in text
    assert (tmp_path / "frontier.png").stat().st_size > 0
