"""Bad input gets a 4xx with a clear message, never a 5xx."""

from __future__ import annotations

import json

import pytest

JSON = {"Content-Type": "application/json"}

BAD_BODIES = {
    "empty query": (json.dumps({"query": ""}), 422, "at least 1 character"),
    "whitespace query": (json.dumps({"query": " \t\n "}), 422, "non-whitespace"),
    "100 KB query": (json.dumps({"query": "x" * 100_000}), 422, "at most 1000 characters"),
    "k=0": (json.dumps({"query": "tree", "k": 0}), 422, "greater than or equal to 1"),
    "k=10000": (json.dumps({"query": "tree", "k": 10_000}), 422, "less than or equal to 100"),
    "k as string": (json.dumps({"query": "tree", "k": "10"}), 422, "valid integer"),
    "k as float": (json.dumps({"query": "tree", "k": 2.5}), 422, "valid integer"),
    "k as bool": (json.dumps({"query": "tree", "k": True}), 422, "valid integer"),
    "query as number": (json.dumps({"query": 5}), 422, "valid string"),
    "query as list": (json.dumps({"query": ["a"]}), 422, "valid string"),
    "missing query": (json.dumps({"k": 3}), 422, "Field required"),
    "unknown field": (json.dumps({"query": "tree", "limit": 3}), 422, "Extra inputs"),
    "unknown route": (json.dumps({"query": "tree", "route": "fast"}), 422, "'auto'"),
    "array body": (json.dumps([{"query": "tree"}]), 422, "valid dictionary"),
    "invalid JSON": ('{"query": "tree", ', 422, "not valid JSON"),
    "empty body": ("", 422, "Field required"),
    "non-UTF-8 body": (b'{"query": "caf\xe9"}', 400, "not valid UTF-8"),
    "too large body": (json.dumps({"query": "x" * 300_000}), 413, "exceeds"),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_input_gets_a_clear_4xx(server, case):
    content, status, message = BAD_BODIES[case]
    with server.client() as client:
        response = client.post("/v1/retrieve", content=content, headers=JSON)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"], error
    assert len(response.text) < 5000  # the offending input is not echoed back


def test_wrong_content_type_is_refused(server):
    with server.client() as client:
        response = client.post("/v1/retrieve", content="query=tree",
                               headers={"Content-Type": "text/plain"})
    assert response.status_code == 422


@pytest.mark.parametrize("queries, message", [
    ([], "at least 1 item"),
    ([{"query": "tree"}] * 65, "at most 64 items"),
    ([{"query": "tree"}, {"query": ""}], "queries.1.query"),
])
def test_bad_batches_are_refused(server, queries, message):
    with server.client() as client:
        response = client.post("/v1/retrieve:batch", json={"queries": queries})
    assert response.status_code == 422
    assert message in response.json()["error"]["message"]


def test_unknown_paths_and_methods_are_4xx(server):
    with server.client() as client:
        assert client.get("/v1/nothing").status_code == 404
        assert client.get("/v1/retrieve").status_code == 405
        assert client.delete("/healthz").status_code == 405
