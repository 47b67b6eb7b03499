"""route=auto over HTTP: the fan-out trigger's decision in the answer and the metrics, the
request's `fanout` field, and the AR route's expansion cache (hits on a repeat, bounded)."""

from __future__ import annotations

import math

import pytest

from service.artifacts.bundle import load_bundle
from tests.service.completion import MALFORMED_MARK
from tests.service.live import live_server
from tests.service.scrape import metric

NARROW = "zzyzx"  # a word no catalog text holds: breadth 0


@pytest.fixture(scope="module")
def broad(serving_bundle, benchmark_queries) -> tuple[str, float]:
    """The benchmark query the catalog's texts name most, and its breadth."""
    lexical = load_bundle(serving_bundle).lexical
    query = max((q.query for q in benchmark_queries), key=lexical.breadth)
    return query, math.log1p(lexical.breadth(query))


def test_auto_answers_a_narrow_query_with_single_and_says_why(settings_for, broad):
    query, score = broad
    threshold = score / 2
    with live_server(settings_for(fanout_threshold=threshold)) as live, \
            live.client() as client:
        def ask(text: str, **fields) -> dict:
            response = client.post("/v1/retrieve", json={"query": text, **fields})
            assert response.status_code == 200, response.text
            return response.json()

        narrow = ask(NARROW, user_id="u1")
        assert narrow["route"] == "single" and narrow["arm"] in ("diffusion", "ar")
        assert narrow["fanout"] == {"fanout": False, "reason": "narrow", "score": 0.0,
                                    "threshold": threshold, "lead": 0}
        wide = ask(query, user_id="u1")
        assert wide["route"] == narrow["arm"]  # the user's A/B arm answers a broad query
        assert wide["fanout"]["fanout"] and wide["fanout"]["reason"] == "broad"
        assert wide["fanout"]["score"] == pytest.approx(score, abs=1e-6)
        own = ask(query, route="single")["items"][0]
        assert wide["fanout"]["lead"] == 1 and wide["items"][0] == {**own, "slot": None}
        assert any("led by the query's own 1 nearest" in note for note in wide["notes"])
        forced = ask(NARROW, fanout="always")
        assert forced["route"] != "single" and forced["fanout"]["reason"] == "always"
        assert forced["fanout"]["lead"] == 0 and not any("led by" in n for n in forced["notes"])
        kept = ask(query, fanout="never")
        assert kept["route"] == "single" and kept["fanout"]["reason"] == "never"
        assert ask(NARROW, route="diffusion")["fanout"] is None  # a forced route decides
        assert metric(client, "r4t_fanout_decisions_total", fanout="false",
                      reason="narrow") == 1
        assert metric(client, "r4t_fanout_decisions_total", fanout="true", reason="broad") == 1
        assert metric(client, "r4t_query_breadth_count") == 2  # scored: narrow and broad
        assert client.get("/v1/info").json()["served"]["routing"]["fanout_trigger"][
            "threshold"] == threshold
        refused = client.post("/v1/retrieve", json={"query": query, "fanout": "sometimes"})
        assert refused.status_code == 422


def test_a_repeated_query_takes_its_fanout_from_the_bounded_cache(settings_for,
                                                                   completion_server):
    def asked(query: str) -> int:
        return sum(p.startswith(f"query: {query}\n") for p in completion_server.state.prompts)

    with live_server(settings_for(fanout_cache_size=2)) as live, live.client() as client:
        def ar(query: str) -> dict:
            response = client.post("/v1/retrieve", json={"query": query, "route": "ar"})
            assert response.status_code == 200, response.text
            return response.json()

        hits = metric(client, "r4t_fanout_cache_lookups_total", result="hit")
        first = ar("cache probe one")
        again = ar("Cache  PROBE one")  # the same query, normalised
        assert asked("cache probe one") == 1 and asked("Cache PROBE one") == 0
        assert again["subqueries"] == first["subqueries"]
        assert "fan-out from the expansion cache" in again["notes"]
        assert "fan-out from the expansion cache" not in first["notes"]
        assert metric(client, "r4t_fanout_cache_lookups_total", result="hit") == hits + 1
        ar("cache probe two")
        ar("cache probe three")  # a third query evicts the least recently used: "one"
        assert metric(client, "r4t_fanout_cache_entries") == 2
        ar("cache probe one")
        assert asked("cache probe one") == 2
        ar("cache probe three")
        assert asked("cache probe three") == 1  # still held


def test_a_malformed_fanout_is_not_cached(settings_for, completion_server):
    """An early stop or an empty completion is served (filled by dense neighbours) but not
    replayed for every repeat of the query: the next ask goes to the model again."""
    query = f"cache probe {MALFORMED_MARK}"

    def asked() -> int:
        return sum(p.startswith(f"query: {query}\n") for p in completion_server.state.prompts)

    with live_server(settings_for(fanout_cache_size=8)) as live, live.client() as client:
        entries = metric(client, "r4t_fanout_cache_entries")  # the warm-up's, well formed
        for expected in (1, 2):
            response = client.post("/v1/retrieve", json={"query": query, "route": "ar"})
            assert response.status_code == 200, response.text
            body = response.json()
            assert any(note.startswith("malformed fan-out") for note in body["notes"])
            assert "fan-out from the expansion cache" not in body["notes"]
            assert asked() == expected
        assert metric(client, "r4t_fanout_cache_entries") == entries
