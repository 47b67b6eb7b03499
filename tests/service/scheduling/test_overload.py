"""Overload → fast 429 with Retry-After; deadlines → 504; clients that left are skipped.

The AR path is kept busy by holding the stand-in completion server's answers
(`holding_completions`) until the test has seen, in the service's metrics, what it waits for;
no test orders its steps by sleeping.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.service.completion import holding_completions
from tests.service.live import WAIT_S, live_server, wait_until
from tests.service.scrape import metric, metric_samples

LONG_DEADLINE_MS = 1000.0 * WAIT_S  # requests held on purpose must not reach their deadline


def overloaded(url: str) -> float:
    return metric(url, "r4t_rejected_requests_total", reason="OverloadError")


async def burst(url: str, n: int, body: dict) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
        return await asyncio.gather(*(client.post("/v1/retrieve", json=body) for _ in range(n)))


def test_full_queue_answers_429_fast_and_recovers(settings_for, completion_server):
    settings = settings_for(max_batch_size=1, queue_size=2, max_batch_queries=1,
                            retry_after_s=2, request_timeout_ms=LONG_DEADLINE_MS)
    with live_server(settings) as live, ThreadPoolExecutor(1) as pool, \
            holding_completions(completion_server) as held:
        sent = pool.submit(asyncio.run, burst(live.url, 12, {"query": "boat", "route": "ar"}))
        # one request held in compute, the queue full behind it, every other one refused
        wait_until(lambda: overloaded(live.url)
                   + metric(live.url, "r4t_queue_depth", route="ar") + held.held == 12,
                   "12 requests held, queued or refused")
        # the queue may have filled before the batcher took the first request off it
        assert held.held == 1 and metric(live.url, "r4t_queue_depth", route="ar") in (1, 2)
        refused_while_held = overloaded(live.url)  # answered before the batch could finish
        held.release()
        responses = sent.result(timeout=WAIT_S)
        codes = [r.status_code for r in responses]
        refused = [r for r in responses if r.status_code == 429]
        assert len(refused) == refused_while_held and codes.count(200) == 12 - len(refused)
        assert 2 <= codes.count(200) <= 3, codes  # the held one and the queue's two at most
        assert all(r.headers["Retry-After"] == "2" for r in refused)
        assert refused[0].json()["error"]["type"] == "OverloadError"
        with live.client() as client:
            assert client.post("/v1/retrieve", json={"query": "boat"}).status_code == 200
        assert overloaded(live.url) == len(refused)


def test_deadline_passed_is_504(settings_for, completion_server):
    settings = settings_for(request_timeout_ms=150, routes="ar=1")
    with live_server(settings) as live, live.client() as client, \
            holding_completions(completion_server):
        # route auto → the ar arm, whose fan-out is held past the deadline
        response = client.post("/v1/retrieve", json={"query": "boat"})
        assert response.status_code == 504
        assert response.json()["error"]["type"] == "DeadlineError"
        durations = metric_samples(client.get("/metrics").text,
                                   "r4t_request_duration_seconds_count")
    # the failure is labelled with the path it was waiting on, not the requested "auto"
    assert any(s.labels == {"route": "ar", "arm": "ar", "status": "504"} for s in durations)


def test_a_request_that_would_wait_past_its_budget_gets_429_not_a_fallback(settings_for):
    with live_server(settings_for(retry_after_s=1)) as live, live.client() as client:
        # the diffusion path's estimate: a batch of 100 s has just started computing
        batcher = live.app.state.r4t.retriever.batchers["diffusion"]
        batcher._computing_s, batcher._computing_since = 100.0, time.monotonic()
        response = client.post("/v1/retrieve", json={"query": "boat", "route": "diffusion"})
        assert response.status_code == 429
        error = response.json()["error"]
        assert error["type"] == "OverloadError" and "expected wait" in error["message"]
        assert 90 <= int(response.headers["Retry-After"]) <= 100  # from the estimate
        text = client.get("/metrics").text
    assert not metric_samples(text, "r4t_fallbacks_total")  # the slower AR path was not tried
    depth = metric_samples(text, "r4t_queue_depth")
    assert [s.value for s in depth if s.labels["route"] == "diffusion"] == [0]


def test_requests_of_clients_that_left_are_skipped(settings_for, completion_server):
    settings = settings_for(max_batch_size=1, request_timeout_ms=LONG_DEADLINE_MS)
    with live_server(settings) as live, ThreadPoolExecutor(1) as pool, \
            holding_completions(completion_server) as held:
        first = pool.submit(httpx.post, f"{live.url}/v1/retrieve",
                            json={"query": "harp", "route": "ar"}, timeout=WAIT_S)
        wait_until(lambda: held.held == 1, "harp's fan-out held in compute")
        with pytest.raises(httpx.ReadTimeout):  # queued behind the held batch: no answer yet
            httpx.post(f"{live.url}/v1/retrieve", json={"query": "gone away", "route": "ar"},
                       timeout=0.2)
        wait_until(lambda: metric(live.url, "r4t_rejected_requests_total",
                                  reason="ClientGone") == 1, "the service saw the client leave")
        assert metric(live.url, "r4t_queue_depth", route="ar") == 1  # still queued
        held.release()
        assert first.result(timeout=WAIT_S).status_code == 200
        wait_until(lambda: metric(live.url, "r4t_skipped_requests_total", route="ar",
                                  reason="cancelled") == 1, "the batcher skipped it")
        text = httpx.get(f"{live.url}/metrics").text
    skipped = metric_samples(text, "r4t_skipped_requests_total")
    assert [s.value for s in skipped if s.labels["route"] == "ar"] == [1]  # nothing else
    assert not any("gone away" in prompt for prompt in completion_server.state.prompts)
    assert any("harp" in prompt for prompt in completion_server.state.prompts)


def test_admission_gate_sheds_load_before_parsing(settings_for, completion_server):
    settings = settings_for(max_in_flight=2, retry_after_s=3,
                            request_timeout_ms=LONG_DEADLINE_MS)
    with live_server(settings) as live, ThreadPoolExecutor(1) as pool, \
            holding_completions(completion_server) as held:
        sent = pool.submit(asyncio.run, burst(live.url, 8, {"query": "boat", "route": "ar"}))
        wait_until(lambda: overloaded(live.url) >= 6, "all but the 2 admitted refused")
        with live.client() as client:  # ops endpoints are never gated
            assert client.get("/healthz").status_code == 200
        held.release()
        responses = sent.result(timeout=WAIT_S)
        codes = [r.status_code for r in responses]
        assert codes.count(200) == 2 and codes.count(429) == 6, codes  # none left while held
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["Retry-After"] == "3"
        assert "in flight" in refused.json()["error"]["message"]


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def leave_mid_request(url: str, n: int, body: dict) -> None:
    """n clients that send a whole request and close their socket before the answer."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    request = (b"POST /v1/retrieve HTTP/1.1\r\nhost: r4t\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
    for _ in range(n):
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(request)
        await writer.drain()
        writer.close()
        await writer.wait_closed()


def test_clients_that_leave_mid_request_leak_no_slot_descriptor_or_worker(
    settings_for, completion_server
):
    settings = settings_for(max_batch_size=1, request_timeout_ms=LONG_DEADLINE_MS)
    with live_server(settings) as live, holding_completions(completion_server) as held:
        with live.client() as client:
            assert client.get("/healthz").status_code == 200
        baseline = open_descriptors()
        asyncio.run(leave_mid_request(live.url, 20, {"query": "gone", "route": "ar"}))
        wait_until(lambda: metric(live.url, "r4t_rejected_requests_total",
                                  reason="ClientGone") == 20, "the service saw all 20 leave")
        held.release()  # the one batch that reached compute finishes; the rest are skipped
        wait_until(lambda: metric(live.url, "r4t_queue_depth", route="ar") == 0
                   and metric(live.url, "r4t_in_flight") == 0, "queue and gate empty")
        wait_until(lambda: open_descriptors() <= baseline, "every socket closed")
        with live.client() as client:  # the worker is free: a new request is answered
            response = client.post("/v1/retrieve", json={"query": "boat", "route": "ar"})
            assert response.status_code == 200
        assert held.held == 0
