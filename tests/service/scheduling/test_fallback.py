"""Diffusion → AR fallback: a broken sampler and the groundedness quality gate."""

from __future__ import annotations

from service.routes import ROUTE_ORDER
from tests.service.live import live_server
from tests.service.scrape import assert_k_unique, metric_samples


def fallback_count(client, reason: str) -> float:
    samples = metric_samples(client.get("/metrics").text, "r4t_fallbacks_total")
    return sum(s.value for s in samples if s.labels["reason"] == reason)


def test_broken_sampler_is_answered_by_ar(settings_for, broken_bundle):
    with live_server(settings_for(bundle=broken_bundle)) as live, live.client() as client:
        assert client.get("/readyz").json()["routes"] == ["ranked", "ar", "hybrid", "single"]
        info = client.get("/v1/info").json()["served"]
        assert "warm-up failed" in info["unavailable"]["diffusion"]
        before = fallback_count(client, "unavailable")
        for route in ("diffusion", "auto"):
            response = client.post("/v1/retrieve", json={"query": "fish", "route": route})
            assert response.status_code == 200
            body = response.json()
            assert_k_unique(body, 10)
            assert body["route"] == "ar"
            if route == "diffusion":
                assert body["fallback"] == {"used": True, "reason": "unavailable"}
        assert fallback_count(client, "unavailable") == before + 1


def test_sampler_errors_at_run_time_fall_back_per_batch(settings_for, fragile_bundle):
    settings = settings_for(bundle=fragile_bundle, max_wait_ms=200.0, warmup_queries=2)
    with live_server(settings) as live, live.client() as client:
        # warm-up (batches of 1 and 2) passed
        assert client.get("/readyz").json()["routes"] == list(ROUTE_ORDER)
        queries = [{"query": q, "route": "diffusion"} for q in ("oak", "elm", "ash")]
        response = client.post("/v1/retrieve:batch", json={"queries": queries})
        assert response.status_code == 200
        for body in response.json()["results"]:  # one batch of 3: the sampler failed
            assert body["route"] == "ar"
            assert body["fallback"] == {"used": True, "reason": "error"}
            assert_k_unique(body, 10)
        assert fallback_count(client, "error") == 3
        single = client.post("/v1/retrieve", json={"query": "oak", "route": "diffusion"}).json()
        assert single["route"] == "diffusion" and not single["fallback"]["used"]


def test_quality_gate_sends_ungrounded_answers_to_ar(settings_for):
    # The tiny export's rows are not catalog items: their mean cos to their nearest items is
    # far below 0.999 (test_app checks it lies in [0, 1]).
    settings = settings_for(groundedness_threshold=0.999)
    with live_server(settings) as live, live.client() as client:
        response = client.post("/v1/retrieve", json={"query": "bird", "route": "diffusion"})
        body = response.json()
        assert response.status_code == 200
        assert body["route"] == "ar" and body["fallback"] == {"used": True, "reason": "quality"}
        assert_k_unique(body, 10)
        assert fallback_count(client, "quality") == 1
        assert "diffusion_attempt" in body["timings_ms"]


def test_model_paths_down_leaves_the_single_route_and_a_503_not_a_500(settings_for,
                                                                      broken_bundle):
    """Both model paths fail their warm-up (a broken sampler, an unreachable endpoint): the
    service stays up on the `single` route, and a request forced onto AR gets a 503."""
    settings = settings_for(bundle=broken_bundle, openai_base_url="http://127.0.0.1:9/v1",
                            openai_retries=0, openai_timeout_s=1.0)
    with live_server(settings) as live, live.client() as client:
        assert client.get("/readyz").json()["routes"] == ["ranked", "hybrid", "single"]
        unavailable = client.get("/v1/info").json()["served"]["unavailable"]
        assert "warm-up failed" in unavailable["diffusion"]
        assert "ConnectError" in unavailable["ar"]
        auto = client.post("/v1/retrieve", json={"query": "fish"}).json()
        assert (auto["route"], auto["arm"]) == ("ranked", "ranked")  # the best route loaded
        assert_k_unique(auto, 10)
        forced = client.post("/v1/retrieve", json={"query": "fish", "route": "diffusion"})
        assert forced.json()["route"] == "single"
        assert forced.json()["fallback"] == {"used": True, "reason": "unavailable"}
        response = client.post("/v1/retrieve", json={"query": "fish", "route": "ar"})
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["type"] == "UnavailableError" and "ar route is unavailable" in error["message"]


def test_injected_sampler_faults_are_answered_by_ar(settings_for):
    settings = settings_for(fault_diffusion_rate=1.0, routes="diffusion=1")
    with live_server(settings) as live, live.client() as client:  # warm-up is never faulted
        assert client.get("/readyz").json()["routes"] == list(ROUTE_ORDER)
        for query in ("oak", "harp", "boat"):
            body = client.post("/v1/retrieve", json={"query": query}).json()
            assert body["arm"] == "diffusion" and body["route"] == "ar"
            assert body["fallback"] == {"used": True, "reason": "error"}
            assert_k_unique(body, 10)
        assert fallback_count(client, "error") == 3
        assert client.get("/v1/info").json()["settings"]["fault_diffusion_rate"] == 1.0


def test_a_fault_rate_between_fails_that_share_of_batches(settings_for):
    settings = settings_for(fault_diffusion_rate=0.5, seed=7, max_batch_size=1)
    with live_server(settings) as live, live.client() as client:
        routes = [client.post("/v1/retrieve", json={"query": "fish", "route": "diffusion"}
                              ).json()["route"] for _ in range(40)]
        assert 8 <= routes.count("ar") <= 32, routes  # binomial(40, 0.5): outside is < 1e-4
        assert fallback_count(client, "error") == routes.count("ar")


def test_an_ar_failure_after_a_diffusion_fallback_is_answered_by_single(settings_for,
                                                                         completion_server):
    """diffusion → ar → single: the sampler fails, then the AR endpoint fails too (503s past
    its retries); the answer comes from `single`, still saying why diffusion did not answer.
    A request forced onto AR keeps its 503."""
    settings = settings_for(fault_diffusion_rate=1.0, routes="diffusion=1", openai_retries=0)
    with live_server(settings) as live, live.client() as client:
        completion_server.state.fail_next = 2
        try:
            body = client.post("/v1/retrieve", json={"query": "oak", "route": "diffusion"})
            assert body.status_code == 200, body.text
            assert body.json()["route"] == "single"
            assert body.json()["fallback"] == {"used": True, "reason": "error"}
            assert_k_unique(body.json(), 10)
            forced = client.post("/v1/retrieve", json={"query": "oak", "route": "ar"})
            assert forced.status_code == 503
        finally:
            completion_server.state.fail_next = 0


def test_a_failing_ar_arm_is_answered_by_single_and_counted(settings_for, completion_server):
    """A/B put the user on AR and the AR endpoint fails: `single` answers with the reason
    "error", counted; a request that named `ar` itself keeps its 503."""
    settings = settings_for(routes="ar=1", openai_retries=0)
    with live_server(settings) as live, live.client() as client:
        before = fallback_count(client, "error")
        completion_server.state.fail_next = 1
        try:
            body = client.post("/v1/retrieve", json={"query": "oak", "fanout": "always"})
            assert body.status_code == 200, body.text
            assert (body.json()["arm"], body.json()["route"]) == ("ar", "single")
            assert body.json()["fallback"] == {"used": True, "reason": "error"}
            assert_k_unique(body.json(), 10)
            assert fallback_count(client, "error") == before + 1
            completion_server.state.fail_next = 1
            forced = client.post("/v1/retrieve", json={"query": "oak", "route": "ar"})
            assert forced.status_code == 503
        finally:
            completion_server.state.fail_next = 0
