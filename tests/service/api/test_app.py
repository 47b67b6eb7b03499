"""The live service over HTTP: readiness, both routes, batch calls, A/B stickiness, metrics."""

from __future__ import annotations

import pytest

from service.fanout.candidates import Candidates
from service.loopback import wait_ready
from tests.service.bundles import CONTEXT, CONTEXT_SOURCE, DRAWS, ROWS, SOLVER, STEPS
from tests.service.completion import MALFORMED_MARK, holding_completions
from tests.service.live import live_server, wait_until
from tests.service.scrape import assert_k_unique, metric_samples


def test_readyz_is_503_until_warm_then_200(settings_for, completion_server):
    with holding_completions(completion_server) as held, \
            live_server(settings_for(), ready=False) as live, live.client() as client:
        assert client.get("/healthz").status_code == 200
        wait_until(lambda: held.held > 0, "the AR warm-up reached the completion server")
        early = client.get("/readyz")  # the warm-up is held: not ready, whatever the speed
        assert early.status_code == 503
        assert early.json()["status"] == "loading"
        refused = client.post("/v1/retrieve", json={"query": "tree"})
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "UnavailableError"
        held.release()
        wait_ready(f"{live.url}/readyz", poll_s=0.05)
        ready = client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json() == {"status": "ready", "bundle": "svc", "building": False,
                                "routes": ["diffusion", "ranked", "ar", "hybrid", "single"]}


@pytest.mark.parametrize("route", ["diffusion", "ranked", "ar", "hybrid", "single"])
def test_retrieve_returns_k_unique_items_on_every_route(server, benchmark_queries, route):
    with server.client() as client:
        query = benchmark_queries[0].query
        response = client.post("/v1/retrieve", json={"query": query, "route": route})
    assert response.status_code == 200
    body = response.json()
    assert_k_unique(body, 10)
    assert body["route"] == route and body["arm"] == "override"
    assert body["fallback"] == {"used": False, "reason": None}
    assert body["bundle"] == "svc"
    assert {"queue", "encode", "search", "total"} <= set(body["timings_ms"])
    stage = {"diffusion": "solver", "ranked": "rank", "ar": "decode", "hybrid": "candidates",
             "single": "search"}[route]
    assert stage in body["timings_ms"]
    assert 0.0 < body["groundedness"] <= 1.0
    scores = [item["score"] for item in body["items"]]
    assert all(-1.0 <= s <= 1.0 + 1e-5 for s in scores)


@pytest.mark.parametrize("k", [1, 3, 25])
def test_any_k_gives_k_distinct_items(server, k):
    with server.client() as client:
        for route in ("diffusion", "ranked", "ar", "hybrid", "single"):
            response = client.post("/v1/retrieve", json={"query": "dog", "k": k, "route": route})
            assert response.status_code == 200, response.text
            assert_k_unique(response.json(), k)


@pytest.mark.parametrize("k", [10, 25])
def test_diffusion_items_are_claimed_among_the_context(server, serving_bundle, k):
    """The served export generates rows = 10 probes per query, which claim items among the
    query's context (the 16 items its fan-out prompt names): k = 10 gives one context item per
    row; k = 25, past the context, claims all 16 and fills the rest from the query's dense
    neighbours, noted as such."""
    from service.artifacts.bundle import load_bundle
    from service.routes.diffusion import DiffusionContext
    from service.runtime.encoder import Encoder
    from service.runtime.sampler import read_config

    bundle = load_bundle(serving_bundle)
    query = "musical instrument"
    context = DiffusionContext(bundle, read_config(serving_bundle / "diffusion")).rows(
        [query], Encoder(bundle.encoder_config).encode([query]))[0]  # (C,)
    assert len(set(context.tolist())) == CONTEXT  # the catalog names that many near the query
    with server.client() as client:
        body = client.post("/v1/retrieve", json={"query": query, "k": k, "route": "diffusion"}
                           ).json()
    assert_k_unique(body, k)
    ids = {bundle.items.ids[row] for row in context.tolist()}
    claimed = [item for item in body["items"] if item["slot"] is not None]
    assert {item["id"] for item in claimed} == ids if k > CONTEXT else len(claimed) == k
    assert all(item["id"] in ids for item in claimed)
    claims = [[item["slot"] for item in claimed].count(row) for row in range(10)]  # per row
    assert min(claims) >= 1 and max(claims) == -(-len(claimed) // 10)
    assert (body["notes"] == []) == (k <= CONTEXT)
    assert 0.0 <= body["groundedness"] <= 1.0


def test_single_route_is_the_querys_own_nearest_items(server, serving_bundle):
    from service.artifacts.bundle import load_bundle
    from service.runtime.encoder import Encoder
    from service.runtime.index import search

    bundle = load_bundle(serving_bundle)
    scores, rows = search(bundle.index, Encoder(bundle.encoder_config).encode(["tree"]), 5)
    with server.client() as client:
        body = client.post("/v1/retrieve", json={"query": "tree", "k": 5, "route": "single"}
                           ).json()
    assert [item["id"] for item in body["items"]] == [bundle.items.ids[r] for r in rows[0]]
    assert [item["slot"] for item in body["items"]] == [0] * 5  # one probe: the query
    assert body["groundedness"] == pytest.approx(float(scores[0, 0]), abs=1e-5)


def test_ar_items_match_the_fanout_subqueries(server, benchmark_queries, completion_server):
    query = benchmark_queries[1]
    with server.client() as client:
        body = client.post("/v1/retrieve", json={"query": query.query, "route": "ar"}).json()
    assert f"query: {query.query}\nfan-out:\n" in completion_server.state.prompts
    slots = [item["slot"] for item in body["items"]]
    assert sorted(slots) == list(range(10))  # one item per sub-query, none filled
    assert body["notes"] == []


def test_ar_prompt_carries_the_querys_catalog_neighbours(
    settings_for, serving_bundle, benchmark_queries, completion_server
):
    from service.artifacts.bundle import load_bundle
    from service.fanout.format import PromptBuilder
    from service.runtime.encoder import Encoder

    query = benchmark_queries[2].query
    bundle = load_bundle(serving_bundle)
    expected = PromptBuilder(Candidates(bundle.index), bundle.items.texts, 3).prompts(
        [query], Encoder(bundle.encoder_config).encode([query]))[0]
    with live_server(settings_for(ar_context=3)) as live, live.client() as client:
        response = client.post("/v1/retrieve", json={"query": query, "route": "ar"})
        assert response.status_code == 200, response.text
        assert client.get("/v1/info").json()["served"]["paths"]["ar"]["context"] == 3
    assert "\ncatalog: " in expected and len(expected.split("; ")) == 3
    assert expected in completion_server.state.prompts
    assert_k_unique(response.json(), 10)


def test_malformed_fanout_still_returns_k_items_and_says_so(server):
    with server.client() as client:
        response = client.post(
            "/v1/retrieve", json={"query": f"tent {MALFORMED_MARK}", "route": "ar", "k": 10}
        )
    assert response.status_code == 200
    body = response.json()
    assert_k_unique(body, 10)
    assert any("malformed fan-out" in note for note in body["notes"])
    assert any(item["slot"] is None for item in body["items"])  # filled from dense neighbours


def test_batch_endpoint_answers_each_query(server, benchmark_queries):
    queries = [{"query": q.query, "k": 5 + i, "route": "auto"}
               for i, q in enumerate(benchmark_queries[:4])]
    with server.client() as client:
        response = client.post("/v1/retrieve:batch", json={"queries": queries})
    assert response.status_code == 200
    results = response.json()["results"]
    assert len(results) == len(queries)
    for i, result in enumerate(results):
        assert_k_unique(result, 5 + i)


def test_ab_assignment_is_sticky_per_user(server):
    with server.client() as client:
        def arm(user: str) -> str:
            body = client.post("/v1/retrieve", json={"query": "fruit", "user_id": user}).json()
            return body["arm"]

        arms = {user: arm(user) for user in (f"user-{i}" for i in range(24))}
        assert set(arms.values()) == {"diffusion", "ar"}  # 50/50 weights reach both arms
        for user in list(arms)[:6]:
            assert arm(user) == arms[user]


def test_metrics_cover_requests_stages_batches_and_bundle(server):
    with server.client() as client:
        client.post("/v1/retrieve", json={"query": "vehicle", "route": "diffusion"})
        text = client.get("/metrics").text
    durations = metric_samples(text, "r4t_request_duration_seconds_count")
    assert any(s.labels == {"route": "diffusion", "arm": "override", "status": "200"}
               for s in durations)
    stages = {s.labels["stage"] for s in metric_samples(text, "r4t_stage_duration_seconds_count")}
    assert {"queue", "encode", "solver", "search", "decode"} <= stages
    assert metric_samples(text, "r4t_batch_size_count")
    info = metric_samples(text, "r4t_bundle_info")
    assert info and "CPUExecutionProvider" in info[0].labels["provider"]
    assert metric_samples(text, "r4t_queue_depth")
    assert metric_samples(text, "r4t_in_flight")


def test_info_reports_manifest_providers_and_routing(server):
    with server.client() as client:
        info = client.get("/v1/info").json()
    served = info["served"]
    diffusion = served["paths"]["diffusion"]["config"]  # the export's diffusion.json
    assert {key: diffusion[key] for key in ("rows", "k", "context", "context_source", "draws",
                                            "solver", "steps")} == {
        "rows": ROWS, "k": ROWS, "context": CONTEXT, "context_source": CONTEXT_SOURCE,
        "draws": DRAWS, "solver": SOLVER, "steps": STEPS}
    stage = served["bundle"]["manifest"]["stages"]["diffusion"]
    assert stage["config"]["export"]["draws"] == DRAWS and stage["sampler"]["rows"] == ROWS
    assert "CPUExecutionProvider" in served["providers"]["diffusion"]
    assert served["routing"]["weights"] == {"ar": 0.5, "diffusion": 0.5}
    assert "admin_token" not in info["settings"] and info["settings"]["admin_api"] is True


def test_request_id_is_echoed(server):
    with server.client() as client:
        response = client.post("/v1/retrieve", json={"query": "tree"},
                               headers={"X-Request-ID": "abc-123"})
        assert response.headers["x-request-id"] == "abc-123"
        generated = client.get("/healthz").headers["x-request-id"]
        assert len(generated) == 32
