"""The OpenAI-compatible backend against the stand-in completion server (real HTTP)."""

from __future__ import annotations

import pytest

from service.errors import UnavailableError
from service.fanout.format import build_prompt, parse_fanout
from service.fanout.openai_backend import OpenAICompletionBackend, OpenAIConfig


def backend(url: str, **kwargs) -> OpenAICompletionBackend:
    return OpenAICompletionBackend(OpenAIConfig(base_url=url, backoff_s=0.01, **kwargs))


def test_one_call_per_batch_in_order(completion_server, benchmark_queries):
    client = backend(completion_server.url)
    queries = [q.query for q in benchmark_queries[:3]] + ["unknown thing"]
    before = completion_server.state.requests
    texts = [g.text for g in client.generate([build_prompt(q) for q in queries])]
    client.close()
    assert completion_server.state.requests == before + 1
    assert parse_fanout(texts[3], 10).subqueries[0] == "unknown thing 1"
    for text in texts:
        assert parse_fanout(text, 10).well_formed


def test_retries_with_backoff_then_succeeds(completion_server):
    completion_server.state.fail_next = 2
    before = completion_server.state.requests
    client = backend(completion_server.url, retries=2)
    assert client.generate(["harp"])[0].text.startswith("harp 1")
    client.close()
    assert completion_server.state.requests == before + 3


def test_gives_up_with_a_clear_error(completion_server):
    completion_server.state.fail_next = 5
    client = backend(completion_server.url, retries=1)
    try:
        with pytest.raises(UnavailableError, match="HTTP 503"):
            client.generate(["harp"])
    finally:
        completion_server.state.fail_next = 0
        client.close()


def test_unreachable_endpoint_is_unavailable():
    client = backend("http://127.0.0.1:9/v1", retries=1, timeout_s=1.0)
    with pytest.raises(UnavailableError, match="ConnectError"):
        client.generate(["harp"])
    client.close()
