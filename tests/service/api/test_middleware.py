"""The admission gate's measure: the concurrency the service has been answering."""

from __future__ import annotations

from service.api.middleware import AdmissionGate, ServedConcurrency


async def never_called(scope, receive, send) -> None:
    raise AssertionError("the gate was only asked for its limit")


def test_served_concurrency_is_the_time_answers_held_over_the_window():
    served = ServedConcurrency(window_s=2.0)
    for end in (10.0, 10.5, 11.0, 11.5):  # four answers of 0.5 s each in 2 s: one at a time
        served.record(end, 0.5)
    assert served.value(11.5) == 1.0
    served.record(11.6, 3.0)  # one slow answer held 3 s
    assert served.value(11.6) == 2.5
    assert served.value(12.6) == 2.0  # 10.0 and 10.5 left the window
    assert served.value(100.0) == 0.0


def test_gate_limit_follows_what_is_answered_never_below_its_floor():
    gate = AdmissionGate(never_called, max_in_flight=512, retry_after_s=1, prefix="/v1",
                         on_reject=lambda duration_s: None, headroom=1.5, floor=8)
    assert gate.limit(0.0) == 512  # nothing answered yet: only the hard cap
    for i in range(40):  # 40 answers of 1 s within the 2 s window: 20 at once
        gate.served.record(1.0 + i * 0.025, 1.0)
    assert gate.limit(2.0) == 30  # 1.5 x 20
    gate.served.record(2.5, 0.01)
    assert gate.limit(4.0) == 8  # the window holds one quick answer: the floor
    unlimited = AdmissionGate(never_called, max_in_flight=64, retry_after_s=1, prefix="/v1",
                              on_reject=lambda duration_s: None)
    unlimited.served.record(1.0, 100.0)
    assert unlimited.limit(1.0) == 64  # without headroom: the hard cap only


def test_a_gate_refusal_has_a_request_id_an_access_line_and_a_duration(caplog):
    """A 429 from the gate is answered as every other request is (issue 41, item 8)."""
    import asyncio
    import json
    import logging

    held, release = asyncio.Event(), asyncio.Event()
    durations: list[float] = []

    async def holding(scope, receive, send) -> None:
        held.set()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def call(gate, headers) -> list[dict]:
        sent: list[dict] = []

        async def send(message) -> None:
            sent.append(message)

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/v1/retrieve", "headers": headers}
        await gate(scope, receive, send)
        return sent

    async def scenario() -> list[dict]:
        gate = AdmissionGate(holding, max_in_flight=1, retry_after_s=1, prefix="/v1",
                             on_reject=durations.append)
        first = asyncio.ensure_future(call(gate, []))
        await held.wait()
        refused = await call(gate, [(b"x-request-id", b"caller-7")])
        release.set()
        await first
        return refused

    with caplog.at_level(logging.INFO, logger="r4t.access"):
        start, body = asyncio.run(scenario())
    assert start["status"] == 429
    headers = dict(start["headers"])
    assert headers[b"x-request-id"] == b"caller-7" and headers[b"retry-after"] == b"1"
    assert json.loads(body["body"])["request_id"] == "caller-7"
    assert len(durations) == 1 and durations[0] >= 0.0
    lines = [r for r in caplog.records if r.name == "r4t.access"]
    assert len(lines) == 1 and lines[0].http["status"] == 429


def test_a_body_still_arriving_holds_no_admission_slot():
    """A client trickling its body (for up to receive_timeout_s) is not counted in flight: a
    whole request beside it is admitted, at a limit of one."""
    import asyncio

    first_chunk, rest = asyncio.Event(), asyncio.Event()
    answered: list[bytes] = []

    async def app(scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        answered.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def trickling():
        chunks = iter([{"type": "http.request", "body": b'{"query":', "more_body": True},
                       {"type": "http.request", "body": b'"x"}', "more_body": False}])

        async def receive() -> dict:
            message = next(chunks)
            if message["more_body"]:
                first_chunk.set()
            else:
                await rest.wait()
            return message
        return receive

    async def whole() -> dict:
        return {"type": "http.request", "body": b'{"query":"y"}', "more_body": False}

    async def call(gate, receive) -> int:
        sent: list[dict] = []

        async def send(message) -> None:
            sent.append(message)

        await gate({"type": "http", "method": "POST", "path": "/v1/retrieve", "headers": []},
                   receive, send)
        return sent[0]["status"]

    async def scenario() -> tuple[int, int]:
        gate = AdmissionGate(app, max_in_flight=1, retry_after_s=1, prefix="/v1",
                             on_reject=lambda _: None)
        slow = asyncio.ensure_future(call(gate, trickling()))
        await first_chunk.wait()
        fast = await call(gate, whole)
        rest.set()
        return fast, await slow

    assert asyncio.run(scenario()) == (200, 200)
    assert answered == [b'{"query":"y"}', b'{"query":"x"}']
