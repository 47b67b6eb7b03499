"""first_answer's step split: each step from the previous marker line to its own, the last to
the first diffusion answer, shares of the whole."""

from __future__ import annotations

from loadtest.first_answer import STEPS, steps


def test_steps_run_between_the_marker_lines_and_end_at_the_first_diffusion_answer() -> None:
    markers = [marker for _, marker in STEPS]
    lines = [{"t_s": 1.0, "line": "pip install ..."},
             {"t_s": 40.0, "line": f".venv/bin/r4t --bundle models/default {markers[0]}"},
             {"t_s": 60.0, "line": f"{markers[1]}: shipped (adopted from x)"},
             {"t_s": 61.0, "line": f"models/default{markers[2]}"}]
    split = steps(lines, answered_s=80.0)
    assert [s["seconds"] for s in split] == [40.0, 20.0, 1.0, 19.0]
    assert [s["end_s"] for s in split] == [40.0, 60.0, 61.0, 80.0]
    assert abs(sum(s["share"] for s in split) - 1.0) < 1e-9
    assert steps(lines[:2], answered_s=None)[0]["share"] is None
