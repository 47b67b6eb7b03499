"""The OpenAI-compatible backend against the stand-in completion server (real HTTP)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from service.artifacts.bundle import load_bundle
from service.backends.openai import OpenAICompletionBackend, OpenAIConfig
from service.errors import DeadlineError, UnavailableError
from service.fanout.format import build_prompt, parse_fanout
from service.routes.answer import RouteQuery
from service.routes.autoregressive import AutoregressiveRoute
from service.runtime.encoder import Encoder
from tests.service.completion import holding_completions
from tests.service.live import WAIT_S, wait_until


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


def test_n_samples_per_prompt_come_back_prompt_major_with_the_calls_tokens(completion_server):
    """Stage 2's use: n samples of each prompt in one call, its seed and regex sent."""
    client = backend(completion_server.url, regex="(.+\\n){9}.+", max_tokens=64)
    generations = client.generate(["harp", "lute"], n=3, seed=7)
    client.close()
    body = completion_server.state.bodies[-1]
    assert (body["n"], body["seed"], body["max_tokens"]) == (3, 7, 64)
    assert body["structured_outputs"] == {"regex": "(.+\\n){9}.+"}
    assert [g.text.split()[0] for g in generations] == ["harp"] * 3 + ["lute"] * 3
    words = sum(len(g.text.split()) for g in generations)  # the stand-in's token count
    assert sum(g.n_tokens for g in generations) == words
    assert max(g.n_tokens for g in generations) - min(g.n_tokens for g in generations) <= 1


def test_a_call_without_a_seed_sends_none(completion_server):
    client = backend(completion_server.url)
    client.generate(["harp"])
    client.close()
    body = completion_server.state.bodies[-1]
    assert "seed" not in body and "structured_outputs" not in body and body["n"] == 1


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


# issue 41 item 3: the batch's deadline bounds every attempt, backoff and retry


BLOCKED_S = WAIT_S / 2  # under the endpoint's hold; reached only by a call ignoring its deadline


def outcome_of(call: Callable[[], Any]) -> Any:
    """What `call` returned or raised, run in a thread the test waits on (an event, bounded by
    BLOCKED_S): a call still blocked then is the bug, a worker kept for a caller that left."""
    outcome: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:  # the outcome under test
            outcome.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(BLOCKED_S), f"the call was still blocked after {BLOCKED_S} s"
    return outcome[0]


@pytest.mark.parametrize("retries", [0, 2])
def test_a_deadline_passing_during_a_held_attempt_ends_the_call(completion_server, retries):
    """The endpoint holds the request: the attempt's timeout (an hour) yields to the deadline,
    and the call ends with a 504 (DeadlineError) after one request, not retries+1 attempts
    each ending in a timeout and then a 503 (UnavailableError)."""
    client = backend(completion_server.url, retries=retries, timeout_s=3600.0)
    before = completion_server.state.requests
    try:
        with holding_completions(completion_server) as state:
            error = outcome_of(lambda: client.generate(["harp"],
                                                       deadline=time.monotonic() + 0.5))
            assert isinstance(error, DeadlineError) and "deadline passed" in str(error)
            wait_until(lambda: state.held == 1, "the one request, held by the endpoint")
    finally:
        client.close()
    assert completion_server.state.requests == before + 1


def test_a_passed_deadline_sends_no_request(completion_server):
    client = backend(completion_server.url, retries=2)
    before = completion_server.state.requests
    try:
        with pytest.raises(DeadlineError):
            client.generate(["harp"], deadline=time.monotonic() - 1.0)
    finally:
        client.close()
    assert completion_server.state.requests == before


def test_no_backoff_sleeps_past_the_deadline(completion_server):
    """A 503, then a backoff (an hour) longer than the time left: the call ends at the
    deadline with a DeadlineError, no second attempt."""
    completion_server.state.fail_next = 5
    before = completion_server.state.requests
    client = OpenAICompletionBackend(OpenAIConfig(base_url=completion_server.url, retries=1,
                                                  backoff_s=3600.0))
    try:
        error = outcome_of(lambda: client.generate(["harp"], deadline=time.monotonic() + 0.5))
    finally:
        completion_server.state.fail_next = 0
        client.close()
    assert isinstance(error, DeadlineError) and "HTTP 503" in str(error)
    assert completion_server.state.requests == before + 1


@pytest.mark.parametrize("far", [False, True], ids=["unbounded", "distant-deadline"])
def test_a_deadline_not_reached_keeps_the_retries_and_the_503(completion_server, far):
    deadline = time.monotonic() + 60.0 if far else None
    completion_server.state.fail_next = 2
    before = completion_server.state.requests
    client = backend(completion_server.url, retries=2)
    try:
        assert client.generate(["harp"], deadline=deadline)[0].text.startswith("harp 1")
        assert completion_server.state.requests == before + 3
        completion_server.state.fail_next = 5
        with pytest.raises(UnavailableError, match="HTTP 503"):  # failed in time: a 503
            client.generate(["harp"], deadline=deadline)
    finally:
        completion_server.state.fail_next = 0
        client.close()
    assert completion_server.state.requests == before + 6


def test_the_ar_path_bounds_the_completion_call_by_the_batch_latest_deadline(
        small_bundle_dir, completion_server):
    """One late request (a body that trickled in) does not doom its batch-mates: the batch is
    bounded by its latest deadline (the late caller's 504 is its batcher's); a batch whose
    every deadline passed fails with a 504 and no completion request."""
    bundle = load_bundle(small_bundle_dir)
    client = backend(completion_server.url, retries=2)
    path = AutoregressiveRoute(bundle, Encoder(bundle.encoder_config), client, fanout_k=10,
                              context=16)
    before = completion_server.state.requests
    try:
        with pytest.raises(DeadlineError):
            path([RouteQuery("boat", 10, deadline=time.monotonic() - 1)] * 2)
        assert completion_server.state.requests == before
        answers = path([RouteQuery("tree", 10, deadline=time.monotonic() + 60.0),
                        RouteQuery("boat", 10, deadline=time.monotonic() - 1)])
    finally:
        client.close()
    assert completion_server.state.requests == before + 1
    assert len(answers) == 2 and len(set(answers[0].selection.rows)) == 10
