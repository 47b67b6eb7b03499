"""A stand-in OpenAI-compatible completion server on loopback (real HTTP), which can hold its
answers on request."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

HOLD_LIMIT_S = 60.0  # the stand-in completion server answers 503 after holding this long
MALFORMED_MARK = "malformed"


def _opened() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass
class CompletionServerState:
    """What the stand-in endpoint answers, and how it misbehaves on request.

    Between `hold()` and `release()` (`holding_completions`), every completion request waits,
    counted in `held`: a test keeps the AR path busy for exactly as long as it needs, however
    fast the machine is.
    """

    fanouts: dict[str, list[str]]
    fail_next: int = 0  # answer this many requests with 503 first
    requests: int = 0
    held: int = 0  # requests waiting on `open` now
    prompts: list[str] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)  # every answered request's
    lock: threading.Lock = field(default_factory=threading.Lock)
    open: threading.Event = field(default_factory=_opened)

    def hold(self) -> None:
        self.open.clear()

    def release(self) -> None:
        self.open.set()

    def completion(self, prompt: str) -> str:
        query = prompt.removeprefix("query: ").split("\n", 1)[0]
        if MALFORMED_MARK in query:
            return "just one line\n\n\nthen garbage " + "x" * 300
        lines = self.fanouts.get(query) or [f"{query} {n}" for n in range(1, 11)]
        return "\n".join(lines)


class _CompletionHandler(BaseHTTPRequestHandler):
    state: CompletionServerState

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length))
        with self.state.lock:
            self.state.requests += 1
            failing = self.state.fail_next > 0
            self.state.fail_next -= int(failing)
        if failing:
            self._send(503, {"error": "warming up"})
            return
        with self.state.lock:
            self.state.held += 1
        try:
            released = self.state.open.wait(HOLD_LIMIT_S)
        finally:
            with self.state.lock:
                self.state.held -= 1
        if not released:
            self._send(503, {"error": f"held for over {HOLD_LIMIT_S} s: a test never released it"})
            return
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        self.state.prompts.extend(prompts)
        self.state.bodies.append(body)
        n = int(body.get("n", 1))
        texts = [self.state.completion(p) for p in prompts for _ in range(n)]
        choices = [{"index": i, "text": text, "finish_reason": "stop"}
                   for i, text in enumerate(texts)]
        usage = {"completion_tokens": sum(len(text.split()) for text in texts)}
        self._send(200, {"object": "text_completion", "model": body.get("model"),
                         "choices": choices, "usage": usage})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (its deadline)
            return

    def log_message(self, *args: Any) -> None:
        return None


@dataclass
class CompletionServer:
    url: str
    state: CompletionServerState


@contextmanager
def holding_completions(server: CompletionServer) -> Iterator[CompletionServerState]:
    """Completion requests wait until the block ends or `state.release()` is called (or
    HOLD_LIMIT_S passed). Release before a live server in the block shuts down, or its
    shutdown waits on the held batch."""
    server.state.hold()
    try:
        yield server.state
    finally:
        server.state.release()


def asked(completion: CompletionServer, query: str) -> int:
    """Completion requests the AR route has sent for `query`."""
    return sum(p.startswith(f"query: {query}\n") for p in completion.state.prompts)
