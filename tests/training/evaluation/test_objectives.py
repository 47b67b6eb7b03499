"""The label-free objective table: each stage-1 reward's greedy set over the prompt's names."""

from __future__ import annotations

import json

import numpy as np
import pytest

from service.runtime.encoder import normalize
from training.evaluation.ceilings import run_ceilings
from training.evaluation.objectives import PROMPT_ORDER, greedy_set, objective
from training.stage1_fanout.grpo import REWARD_MODES


def test_greedy_aboutness_takes_the_matched_items_in_prompt_order():
    items = normalize(np.random.default_rng(0).normal(size=(6, 8)))
    about = np.array([False, True, False, True, True, False])
    assert greedy_set("about", items[0], items, about, k=3) == [1, 3, 4]


def test_the_paper_composite_prefers_a_diverse_set_to_duplicates():
    rng = np.random.default_rng(1)
    query = normalize(rng.normal(size=8))
    spread = normalize(query + 0.8 * rng.normal(size=(4, 8)))  # (4, d) near the query, spread out
    twins = np.repeat(spread[:1], 4, axis=0)  # (4, d) one item four times
    scores = objective("all", query, np.stack([spread, twins]), np.zeros((2, 4), dtype=bool))
    assert scores[0] > scores[1]


def test_ceilings_carry_one_objective_row_per_reward(small_bundle_dir):
    report = json.loads(run_ceilings(small_bundle_dir, "test").read_text())
    rows = {r["objective"]: r for r in report["objectives"]}
    assert set(rows) == {PROMPT_ORDER, *REWARD_MODES}
    for row in rows.values():
        assert 0.0 <= row["coverage@10"] <= 1.0 and row["se"] >= 0.0
    # every set is drawn from the prompt's names, so none beats their label ceiling
    prompt = {r["candidates"]: r for r in report["rows"]}["prompt names, hybrid (24)"]
    assert max(r["coverage@10"] for r in rows.values()) <= prompt["ceiling@10"] + 1e-9
    assert rows[PROMPT_ORDER]["coverage@10"] == pytest.approx(rows["ground"]["coverage@10"])
