"""Hostile inputs over HTTP: a batch call at the limits of each kind a caller can send cheaply
(empty, 1,000 characters, frequent words, never-seen words, FTS5 syntax, emoji filters, HTML),
spread over every route, on the live service: every answer a 200 or a clear 4xx, never a 5xx,
and the service still answers after them. (Their cost under load: `make chaos`, case
`hostile`, which holds /healthz's p99 while a client sends them in a loop.)"""

from __future__ import annotations

import pytest

from loadtest.hostile import HOSTILE, hostile_batch
from service.limits import MAX_BATCH_QUERIES, MAX_QUERY_CHARS
from tests.service.live import live_server


@pytest.fixture(scope="module")
def hostile_server(settings_for):
    """The service as shipped, a generous deadline: the test is about answers, not speed."""
    with live_server(settings_for(request_timeout_ms=120_000, routes=None)) as live:
        yield live


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_batch_of_hostile_queries_on_every_route_is_answered(hostile_server, kind):
    with hostile_server.client() as client:
        response = client.post("/v1/retrieve:batch", json=hostile_batch(kind), timeout=300)
        assert response.status_code == 200 or 400 <= response.status_code < 500, response.text
        if response.status_code != 200:
            assert response.json()["error"]["message"]  # a clear 4xx says why
        else:
            assert len(response.json()["results"]) == MAX_BATCH_QUERIES
        assert client.get("/healthz").status_code == 200
        after = client.post("/v1/retrieve", json={"query": "dog", "route": "single"})
        assert after.status_code == 200


@pytest.mark.parametrize("query", ["", "   ", "x" * (MAX_QUERY_CHARS + 1)])
def test_an_empty_or_overlong_query_is_a_clear_422(hostile_server, query):
    with hostile_server.client() as client:
        response = client.post("/v1/retrieve:batch",
                               json={"queries": [{"query": query}] * MAX_BATCH_QUERIES})
        assert response.status_code == 422 and "query" in response.text
