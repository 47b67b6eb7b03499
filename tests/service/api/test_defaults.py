"""The service as shipped: one live server over the serving bundle with every setting at its
default (tests/service/conftest.py `shipped_settings`), where the rest of the suite switches the
safety defaults off. Admission at its fraction of the deadline, the groundedness gate, the
fan-out trigger, the expansion cache and the HNSW index are all in force here, and each test
checks one of them at work. The expected values are read from service/settings.py and from the
bundle, never written down here, so a changed default is tested as it ships."""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from service.artifacts.bundle import Bundle, load_bundle
from service.artifacts.stages import recorded_routes
from service.routes import ROUTE_ORDER
from service.runtime.index import IndexChoice
from service.settings import FALLBACK_ROUTES, Settings, parse_weights
from tests.service.bundles import ROWS
from tests.service.completion import asked, holding_completions
from tests.service.live import LiveServer, live_server, shipped_settings, wait_until
from tests.service.scrape import assert_k_unique, metric

SHIPPED = {name: field.default for name, field in Settings.model_fields.items()}
NARROW = "zzyzx"  # a word no catalog text holds: breadth 0, below any positive threshold
CACHE_NOTE = "fan-out from the expansion cache"


@pytest.fixture(scope="module")
def bundle(serving_bundle) -> Bundle:
    return load_bundle(serving_bundle)


@pytest.fixture(scope="module")
def shipped(serving_bundle, completion_server) -> Iterator[LiveServer]:
    with live_server(shipped_settings(serving_bundle, completion_server)) as live:
        yield live


@pytest.fixture
def client(shipped: LiveServer) -> Iterator[httpx.Client]:
    with shipped.client() as client:
        yield client


def retrieve(client: httpx.Client, query: str, **fields: Any) -> dict:
    response = client.post("/v1/retrieve", json={"query": query, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_info_reports_the_shipped_defaults_in_force(client, bundle):
    info = client.get("/v1/info").json()
    settings, served = info["settings"], info["served"]
    for name in ("admit_wait_fraction", "request_timeout_ms", "groundedness_threshold",
                 "fanout_threshold", "fanout_lead", "fanout_cache_size", "index", "routes",
                 "max_wait_ms", "max_batch_size"):
        assert settings[name] == SHIPPED[name], name
    # what the loaded service does with them, not only what it was told
    assert served["unavailable"] == {} and set(served["paths"]) == set(ROUTE_ORDER)
    index = served["paths"]["single"]["index"]
    assert index["backend"] == "faiss" and index["index"].startswith("IndexHNSW")
    assert index["choice"] == IndexChoice.parse(SHIPPED["index"]).name
    assert index["rows"] == len(bundle.items)
    routing = served["routing"]
    recorded = recorded_routes(bundle.path)
    assert routing["weights"] == parse_weights(recorded or FALLBACK_ROUTES)
    assert routing["weights_from"] == ("bundle" if recorded else "default")
    assert routing["groundedness_threshold"] == SHIPPED["groundedness_threshold"]
    trigger = routing["fanout_trigger"]
    assert trigger["lexical_index"]
    assert (trigger["threshold"], trigger["lead"]) == (SHIPPED["fanout_threshold"],
                                                       SHIPPED["fanout_lead"])
    assert served["paths"]["ar"]["cache_size"] == SHIPPED["fanout_cache_size"]
    assert all(batcher["max_wait_ms"] == SHIPPED["max_wait_ms"]
               for batcher in served["batching"].values())


def test_every_served_route_answers_k_distinct_items_and_is_counted(client, benchmark_queries):
    routes = client.get("/readyz").json()["routes"]
    assert set(routes) == set(ROUTE_ORDER)  # the bundle serves every route, so each is tested
    query = benchmark_queries[0].query
    gate = SHIPPED["groundedness_threshold"]
    for route in routes:
        before = {r: metric(client, "r4t_request_duration_seconds_count", route=r,
                            arm="override", status="200") for r in ROUTE_ORDER}
        quality = metric(client, "r4t_fallbacks_total", reason="quality")
        body = retrieve(client, query, route=route, k=ROWS)
        assert_k_unique(body, ROWS)
        assert body["arm"] == "override" and body["fanout"] is None
        if body["fallback"]["used"]:  # only the diffusion route falls back, and only to AR
            assert route == "diffusion" and body["route"] == "ar", body
            assert body["fallback"]["reason"] == "quality", body  # the gate, nothing broken
            assert metric(client, "r4t_fallbacks_total", reason="quality") == quality + 1
        else:
            assert body["route"] == route
            assert metric(client, "r4t_fallbacks_total", reason="quality") == quality
            if route == "diffusion":  # the gate let it through: grounded enough
                assert body["groundedness"] >= gate
        after = {r: metric(client, "r4t_request_duration_seconds_count", route=r,
                           arm="override", status="200") for r in ROUTE_ORDER}
        assert after == {**before, body["route"]: before[body["route"]] + 1}


def test_auto_fans_out_exactly_the_queries_the_shipped_trigger_calls_broad(
        client, bundle, benchmark_queries):
    lexical = bundle.lexical
    threshold = SHIPPED["fanout_threshold"]
    broad = max((q.query for q in benchmark_queries), key=lexical.breadth)
    score = math.log1p(lexical.breadth(broad))
    assert score >= threshold, (
        f"no benchmark query reaches the shipped threshold {threshold} (broadest: {broad!r} "
        f"at {score:.2f}): route=auto would never fan out on this catalog")
    decisions = {fanout: metric(client, "r4t_fanout_decisions_total", fanout=fanout,
                                reason=reason)
                 for fanout, reason in (("true", "broad"), ("false", "narrow"))}

    narrow = retrieve(client, NARROW, user_id="shipped-user", k=ROWS)
    assert narrow["route"] == "single" and narrow["arm"] in ROUTE_ORDER
    assert narrow["fanout"] == {"fanout": False, "reason": "narrow", "score": 0.0,
                                "threshold": threshold, "lead": 0}
    assert_k_unique(narrow, ROWS)

    wide = retrieve(client, broad, user_id="shipped-user", k=ROWS)
    assert wide["arm"] == narrow["arm"]  # sticky per user
    decision = wide["fanout"]
    assert decision["fanout"] and decision["reason"] == "broad"
    assert decision["score"] == pytest.approx(score, abs=1e-6)
    assert decision["lead"] == SHIPPED["fanout_lead"]
    # the user's arm answers (or, the arm being diffusion, AR by the gate's fallback)
    assert wide["route"] == ("ar" if wide["fallback"]["used"] else wide["arm"]), wide
    assert_k_unique(wide, ROWS)
    own = retrieve(client, broad, route="single", k=ROWS)["items"]
    lead = SHIPPED["fanout_lead"]
    assert [item["id"] for item in wide["items"][:lead]] == [i["id"] for i in own[:lead]]
    assert metric(client, "r4t_fanout_decisions_total", fanout="true",
                  reason="broad") == decisions["true"] + 1
    assert metric(client, "r4t_fanout_decisions_total", fanout="false",
                  reason="narrow") == decisions["false"] + 1


def test_a_repeated_ar_query_is_served_from_the_shipped_cache(client, completion_server):
    query = "shipped cache probe"
    hits = metric(client, "r4t_fanout_cache_lookups_total", result="hit")
    first = retrieve(client, query, route="ar", k=ROWS)
    again = retrieve(client, "Shipped  CACHE probe", route="ar", k=ROWS)  # normalised alike
    assert CACHE_NOTE not in first["notes"] and CACHE_NOTE in again["notes"]
    assert asked(completion_server, query) == 1  # the repeat never reached the model
    assert again["subqueries"] == first["subqueries"] and again["route"] == "ar"
    assert [i["id"] for i in again["items"]] == [i["id"] for i in first["items"]]
    assert metric(client, "r4t_fanout_cache_lookups_total", result="hit") == hits + 1
    assert metric(client, "r4t_fanout_cache_entries") >= 1


def test_a_request_behind_a_stalled_path_is_refused_at_the_shipped_fraction(
        client, shipped, completion_server):
    """While an AR batch hangs on its fan-out model, the expected wait of the next AR request
    grows; past the shipped fraction of its deadline it gets a 429 at once (with the harness's
    fraction of 1.0 it would be admitted and wait up to the whole deadline)."""
    budget_ms = SHIPPED["admit_wait_fraction"] * SHIPPED["request_timeout_ms"]
    refused = metric(client, "r4t_rejected_requests_total", reason="OverloadError")

    def ar_wait() -> dict:
        return client.get("/v1/info").json()["served"]["batching"]["ar"]

    with holding_completions(completion_server) as held, ThreadPoolExecutor(1) as pool, \
            shipped.client() as other:
        stalled = pool.submit(other.post, "/v1/retrieve",
                              json={"query": "shipped stalled probe", "route": "ar", "k": ROWS})
        wait_until(lambda: held.held > 0, "the AR batch reached the completion server")
        # past its estimate a batch's expected wait grows with its overrun: once the wait
        # exceeds estimate + budget it is past the estimate, and only grows from here
        wait_until(lambda: (lambda b: b["expected_wait_ms"] > b["batch_ms_estimate"]
                            + budget_ms)(ar_wait()), "the stalled AR path's wait passed the "
                   "admission budget")
        response = client.post("/v1/retrieve", json={"query": "shipped refused probe",
                                                     "route": "ar"})
        assert response.status_code == 429, response.text
        assert response.json()["error"]["type"] == "OverloadError"
        assert int(response.headers["Retry-After"]) >= SHIPPED["retry_after_s"]
        held.release()
        answered = stalled.result()
    assert answered.status_code == 200, answered.text
    assert_k_unique(answered.json(), ROWS)
    assert asked(completion_server, "shipped refused probe") == 0
    assert metric(client, "r4t_rejected_requests_total", reason="OverloadError") == refused + 1
