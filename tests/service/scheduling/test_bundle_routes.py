"""A bundle serves the route that measured best on its own val split (its `routes` stage),
unless R4T_ROUTES says otherwise."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from service.artifacts.bundle import read_manifest
from service.artifacts.stages import ROUTES_FILE
from service.settings import Settings
from tests.service.live import live_server
from training.evaluation.routes import RoutesConfig, choose, select_routes, weights

CONFIG = RoutesConfig()


def row(coverage: float, recall: float) -> dict[str, float]:
    return {"coverage@10": coverage, "recall@5k": recall}


@pytest.mark.parametrize("table, best", [
    ({"diffusion": row(0.21, 0.62), "ranked": row(0.28, 0.63), "single": row(0.16, 0.57)},
     "ranked"),
    ({"diffusion": row(0.21, 0.62), "ranked": row(0.28, 0.50), "single": row(0.16, 0.57)},
     "diffusion"),  # the ranked route loses recall to single: not a fair winner
    ({"ranked": row(0.28, 0.50), "single": row(0.16, 0.57)}, "single"),
    ({"diffusion": row(0.20, 0.62), "ranked": row(0.21, 0.60), "hybrid": row(0.24, 0.58),
      "single": row(0.16, 0.57)}, "hybrid"),  # no learned route beats the free heuristic
])
def test_the_best_fanout_that_keeps_singles_recall_wins(table, best):
    assert choose(table, CONFIG) == best


def measured(coverage: list[float], recall: float, ms: float) -> dict:
    return {"coverage@10": sum(coverage) / len(coverage), "recall@5k": recall,
            "cpu_ms_per_query": ms, "per_query": coverage}


def test_a_route_tied_with_the_best_on_val_wins_when_it_is_cheaper():
    rng = np.random.default_rng(0)
    best = rng.uniform(0, 0.6, 90).tolist()
    near = [c - 0.1 if i in (3, 7) else c for i, c in enumerate(best)]  # a hair below
    far = [max(0.0, c - 0.1) for c in best]  # clearly below
    single = measured([0.1] * 90, 0.5, 0.2)
    tied = {"ranked": measured(best, 0.6, 5.0), "diffusion": measured(near, 0.6, 1.0),
            "single": single}
    assert choose(tied, CONFIG) == "diffusion"
    apart = {"ranked": measured(best, 0.6, 5.0), "diffusion": measured(far, 0.6, 1.0),
             "single": single}
    assert choose(apart, CONFIG) == "ranked"
    dearer = {"ranked": measured(best, 0.6, 5.0), "diffusion": measured(near, 0.6, 9.0),
              "single": single}
    assert choose(dearer, CONFIG) == "ranked"


def test_a_price_the_rounds_disagree_on_leaves_a_tie_to_the_route_order():
    from training.evaluation.routes import COST_ROUNDS

    rng = np.random.default_rng(0)
    best = rng.uniform(0, 0.6, 90).tolist()
    near = [c - 0.1 if i in (3, 7) else c for i, c in enumerate(best)]
    single = measured([0.1] * 90, 0.5, 0.2)

    def tied(ranked_rounds: list[float]) -> dict:
        ranked = {**measured(best, 0.6, float(np.median(ranked_rounds))),
                  COST_ROUNDS: ranked_rounds}
        diffusion = {**measured(near, 0.6, 5.0), COST_ROUNDS: [5.0, 5.0, 5.0]}
        return {"ranked": ranked, "diffusion": diffusion, "single": single}

    assert choose(tied([4.0, 6.0, 4.5]), CONFIG) == "diffusion"  # cheaper by its median only
    assert choose(tied([4.0, 4.9, 4.5]), CONFIG) == "ranked"  # cheaper in every round


def test_a_recall_a_hair_below_single_s_is_noise_and_a_clear_loss_is_not():
    rng = np.random.default_rng(1)
    recall = rng.uniform(0.7, 1.0, 28)
    single = {**measured([0.3] * 28, float(recall.mean()), 0.2),
              "per_query_recall@5k": recall.tolist()}
    hair = [r - 0.05 if i in (2, 9) else r for i, r in enumerate(recall)]  # two queries
    clear = (recall - 0.05).tolist()  # every query
    ranked = measured([0.45] * 28, float(np.mean(hair)), 5.0)
    assert choose({"ranked": {**ranked, "per_query_recall@5k": hair}, "single": single},
                  CONFIG) == "ranked"
    lost = {**ranked, "recall@5k": float(np.mean(clear)), "per_query_recall@5k": clear}
    assert choose({"ranked": lost, "single": single}, CONFIG) == "single"


def test_weights_keep_the_ar_arm_only_where_there_is_one():
    assert weights("ranked", True, CONFIG) == "ranked=0.9,ar=0.1"
    assert weights("ranked", False, CONFIG) == "ranked=1"
    assert weights("single", True, CONFIG) == "single=1"


def test_the_measured_choice_is_served_and_r4t_routes_overrides_it(serving_bundle, tmp_path,
                                                                    settings_for):
    bundle = tmp_path / "measured"
    shutil.copytree(serving_bundle, bundle)
    select_routes(bundle)
    measured = json.loads((bundle / ROUTES_FILE).read_text())
    assert set(measured["table"]) == {"diffusion", "ranked", "hybrid", "single"}
    assert read_manifest(bundle)["stages"]["routes"]["weights"] == measured["weights"]
    best = measured["weights"].split("=")[0]
    assert best == choose(measured["table"], CONFIG)
    with live_server(settings_for(bundle=bundle, routes=None)) as live, live.client() as client:
        routing = client.get("/v1/info").json()["served"]["routing"]
        assert routing["weights_from"] == "bundle"
        assert max(routing["weights"], key=routing["weights"].get) == best
        answer = client.post("/v1/retrieve", json={"query": "tree", "user_id": "u1"}).json()
        assert answer["arm"] in routing["weights"]
    with live_server(settings_for(bundle=bundle, routes="single=1")) as live, \
            live.client() as client:
        routing = client.get("/v1/info").json()["served"]["routing"]
        assert (routing["weights_from"], routing["weights"]) == ("R4T_ROUTES", {"single": 1.0})


def test_a_tie_goes_to_the_cheaper_route_by_its_median_price_over_interleaved_passes(
        serving_bundle, tmp_path, monkeypatch):
    import training.evaluation.routes as routes

    # the quality pass (exact index), then the served index: ranked looks cheaper only in
    # diffusion's first, disturbed pass there
    prices = {"diffusion": [99.0, 50.0, 30.0, 31.0], "ranked": [10.0, 40.0, 44.0, 45.0],
              "hybrid": [35.0], "single": [5.0]}
    quality = {"diffusion": 0.30, "ranked": 0.31, "hybrid": 0.10, "single": 0.05}
    calls: list[str] = []
    indexes: list = []

    def evaluate(bundle, route, split, seeds=1):
        calls.append(route)
        indexes.append(bundle.index.describe()["choice"])
        swing = 0.2 * (-1) ** np.arange(20) if route == "diffusion" else np.zeros(20)
        per_query = (quality[route] + swing).tolist()  # diffusion: tied with ranked, noisily
        return {"metrics": {"coverage@10": quality[route], "recall@5k": 0.6,
                            "precision@10": 0.1, "latency_ms_per_query": 1.0},
                "diagnostics": {routes.COST: prices[route][calls.count(route) - 1],
                                "per_query": {"coverage@10": per_query,
                                              "recall@5k": [0.6] * 20}}}

    monkeypatch.setattr(routes, "evaluate", evaluate)
    bundle = tmp_path / "priced"
    shutil.copytree(serving_bundle, bundle)
    select_routes(bundle)
    table = json.loads((bundle / ROUTES_FILE).read_text())["table"]
    assert {r: table[r][routes.COST] for r in prices} == {  # hybrid and single: one pass
        "diffusion": 31.0, "ranked": 44.0, "hybrid": 35.0, "single": 5.0}
    # every route once, then the two tied on quality three times, interleaved
    assert calls == ["diffusion", "ranked", "hybrid", "single"] + ["diffusion", "ranked"] * 3
    assert indexes[:4] == ["bundle"] * 4  # quality on the exact index
    assert indexes[4:] == [Settings(bundle=bundle).index] * 6  # prices on the served one
    # tied on quality, the cheaper by the median serves (one pass would have served ranked)
    assert read_manifest(bundle)["stages"]["routes"]["weights"].startswith("diffusion=")
