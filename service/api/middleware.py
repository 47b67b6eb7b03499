"""ASGI middleware: request ids and access logs, and guards that refuse before any parsing.

- RequestContext: the caller's `X-Request-ID` (or a new one) on every log line and the response.
- AdmissionGate: an immediate 429 past `max_in_flight`, a request counted once its body has
  arrived, so shedding load costs next to nothing and a trickling client holds no slot.
- BodyGuard: 413 past `max_body_bytes` (chunked bodies included), 400 for a body not UTF-8.
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REQUEST_ID_HEADER = b"x-request-id"
ARRIVAL_KEY = "r4t.arrival"  # time.monotonic() when the request reached the app
MAX_REQUEST_ID_CHARS = 64
SERVED_WINDOW_S = 2.0  # long enough to hold many batches, short enough to follow the load
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "r4t_request_id", default=None
)
access_log = logging.getLogger("r4t.access")


def current_request_id() -> str | None:
    return request_id_var.get()


def _caller_request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", []):
        if name == REQUEST_ID_HEADER:
            text = value.decode("latin-1")
            if 0 < len(text) <= MAX_REQUEST_ID_CHARS and text.isprintable():
                return text
    return uuid.uuid4().hex


def log_access(scope: Scope, status: int, duration_s: float) -> None:
    """The access log's one line for a request."""
    access_log.info("request", extra={"http": {
        "method": scope.get("method"), "path": scope.get("path"), "status": status,
        "duration_ms": round(duration_s * 1000, 3)}})


class RequestContext:
    """Request id in context and response headers; one access log line per request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _caller_request_id(scope)
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        scope[ARRIVAL_KEY] = time.monotonic()
        status = {"code": 0}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER, request_id.encode("latin-1")))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log_access(scope, status["code"], time.perf_counter() - started)
            request_id_var.reset(token)


class ServedConcurrency:
    """How many requests were being answered successfully at once, on average, over the last
    `window_s`: the sum of the durations of the 2xx answers that ended in it, over its length
    (Little's law). Slow and fast routes count by the time they hold, each in its own right."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._done: deque[tuple[float, float]] = deque()  # (end, duration)
        self._total = 0.0

    def record(self, end: float, duration: float) -> None:
        self._done.append((end, duration))
        self._total += duration

    def value(self, now: float) -> float:
        while self._done and self._done[0][0] < now - self.window_s:
            self._total -= self._done.popleft()[1]
        if not self._done:
            self._total = 0.0  # no rounding left over from the sums
        return max(self._total, 0.0) / self.window_s


class AdmissionGate:
    """Refuses retrieval requests with an immediate 429, before any body is read or parsed,
    beyond `max_in_flight` (a hard cap), or beyond `headroom` times the concurrency the service
    has been answering successfully (`ServedConcurrency`): far past capacity, the excess is shed
    here at next to no cost, while the per-route batchers refuse precisely, by expected wait,
    what gets through. It never refuses below `floor` requests in flight, nor by concurrency
    when nothing was answered in the window (a burst after a quiet spell)."""

    def __init__(
        self, app: ASGIApp, max_in_flight: int, retry_after_s: int, prefix: str,
        on_reject: Callable[[float], None], headroom: float = 0.0, floor: int = 1,
        max_body_bytes: int = 1 << 20,
    ) -> None:
        self.app, self.max_in_flight, self.prefix = app, max_in_flight, prefix
        self.max_body_bytes = max_body_bytes
        self.retry_after = str(retry_after_s).encode()
        self.headroom, self.floor = headroom, floor
        self.on_reject = on_reject
        self.in_flight = 0
        self.served = ServedConcurrency(SERVED_WINDOW_S)

    def limit(self, now: float) -> int:
        """Requests admitted at once now."""
        served = self.served.value(now)
        if self.headroom <= 0 or served == 0:  # nothing answered lately: nothing to go by
            return self.max_in_flight
        adaptive = max(self.floor, math.ceil(self.headroom * served))
        return min(self.max_in_flight, adaptive)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        limit = self.limit(started)
        if self.in_flight >= limit:  # refused before its body is read: shedding costs nothing
            await self._refuse(scope, send, started, limit)
            return
        arrived = await self._body(receive)  # a body trickling in holds no slot meanwhile
        if arrived is None:  # the client left
            return
        limit = self.limit(time.monotonic())
        if self.in_flight >= limit:
            await self._refuse(scope, send, started, limit)
            return
        receive = _replay_messages(arrived, receive)
        self.in_flight += 1
        status = {"code": 0}

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.in_flight -= 1
            if 200 <= status["code"] < 300:
                ended = time.monotonic()
                self.served.record(ended, ended - started)


    async def _body(self, receive: Receive) -> list[Message] | None:
        """The request's body messages, read until its last or past `max_body_bytes` (what
        BodyGuard then refuses); None when the client disconnects first."""
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            messages.append(message)
            size += len(message.get("body", b""))
            if not message.get("more_body", False) or size > self.max_body_bytes:
                return messages

    async def _refuse(self, scope: Scope, send: Send, started: float, limit: int) -> None:
        """The 429 of a request the gate turns away, answered as every other one is: with its
        request id (header and body), an access log line, and its duration (`on_reject`)."""
        request_id = _caller_request_id(scope)
        token = request_id_var.set(request_id)
        try:
            await _refuse(send, 429, "OverloadError",
                          f"{self.in_flight} requests in flight (admitting {limit} now); "
                          "retry shortly", [(b"retry-after", self.retry_after),
                                            (REQUEST_ID_HEADER, request_id.encode("latin-1"))])
        finally:
            duration = time.monotonic() - started
            self.on_reject(duration)
            log_access(scope, 429, duration)
            request_id_var.reset(token)


class BodyGuard:
    """Bounded, UTF-8-checked request bodies for POST/PUT/PATCH."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _refuse(send, 413, "PayloadTooLarge",
                          f"request body of {declared} bytes exceeds {self.max_body_bytes}")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _refuse(send, 413, "PayloadTooLarge",
                              f"request body exceeds {self.max_body_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            await _refuse(send, 400, "InvalidEncoding",
                          f"request body is not valid UTF-8 (byte {exc.start}: {exc.reason})")
            return
        await self.app(scope, _replay(body, receive), send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay_messages(messages: list[Message], receive: Receive) -> Receive:
    """`receive` that first returns `messages`, then what the client sends next."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` that returns the whole `body` first (later calls wait for the disconnect)."""
    return _replay_messages([{"type": "http.request", "body": body, "more_body": False}],
                            receive)


async def _refuse(
    send: Send, status: int, kind: str, message: str,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    payload = {"error": {"type": kind, "message": message}, "request_id": current_request_id()}
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), *(extra_headers or [])]
    if status == 413:  # the unread body makes the connection unusable
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
