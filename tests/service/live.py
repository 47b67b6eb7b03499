"""Live uvicorn servers on 127.0.0.1 for the service's tests, their settings (as shipped, or
the harness's), and a bounded wait for a condition without an event."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from service.api.app import create_app
from service.api.server import listening, server_for
from service.loopback import free_port, wait_ready
from service.settings import Settings
from tests.service.completion import CompletionServer

ADMIN_TOKEN = "test-admin-token"
WAIT_S = 60.0  # bound on a test's wait for a condition; reached only when something is broken
ENGINE = os.environ.get("R4T_INDEX", "").startswith("milvus")  # serve from Milvus Lite


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll a condition that has no event to wait on, with a bounded deadline."""
    stop = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > stop:
            raise AssertionError(f"{what}: not so after {timeout_s} s")
        time.sleep(0.01)


@dataclass
class LiveServer:
    url: str
    app: Any

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30.0, **kwargs)


@contextmanager
def live_server(settings: Settings, ready: bool = True) -> Iterator[LiveServer]:
    """create_app(settings) under r4t serve's uvicorn server on 127.0.0.1 (a free port), in a
    thread (signals stay with the test process: SIGTERM is tested on `serve_process`)."""
    app = create_app(settings)
    sock = listening("127.0.0.1", 0)
    sockets = [sock] if settings.admin_port is None else [
        sock, listening("127.0.0.1", settings.admin_port)]  # as r4t serve binds them
    server = server_for(settings, app)  # r4t serve's own server: limits, receive deadline
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        stop = time.monotonic() + 30
        while not server.started and time.monotonic() < stop:
            time.sleep(0.01)
        if ready:
            wait_ready(f"{url}/readyz", 120.0, poll_s=0.05)
        yield LiveServer(url, app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        for bound in sockets:
            bound.close()


@contextmanager
def server_process(bundle: Path, completion: CompletionServer, log: Path,
                   **env: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`r4t serve` of `bundle` as a subprocess on loopback (R4T_* overrides in `env`), ready;
    yields (url, process) and stops it (SIGTERM) afterwards if it still runs."""
    port = free_port()
    environment = {**os.environ, "R4T_BUNDLE": str(bundle), "R4T_PORT": str(port),
                   "R4T_HOST": "127.0.0.1", "R4T_OPENAI_BASE_URL": completion.url,
                   "R4T_THREADS": "1", "R4T_DRAIN_S": "0", "R4T_FANOUT_THRESHOLD": "0",
                   **env}
    with log.open("w") as handle:
        process = subprocess.Popen([sys.executable, "-m", "service.command", "serve"],
                                   env=environment, stdout=handle, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(f"{url}/readyz", 120.0, process)
            yield url, process
        finally:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)


@contextmanager
def serve_process(bundle: Path, completion: CompletionServer, log: Path,
                  **env: str) -> Iterator[tuple[str, int]]:
    """`server_process`, yielding (url, port)."""
    with server_process(bundle, completion, log, **env) as (url, _):
        yield url, int(url.rsplit(":", 1)[1])


def make_settings(bundle: Path, completion: CompletionServer | None, **overrides: Any
                  ) -> Settings:
    base: dict[str, Any] = {
        "bundle": bundle, "threads": 1, "faiss_threads": 1, "warmup_queries": 2,
        "routes": "diffusion=0.5,ar=0.5", "admin_token": ADMIN_TOKEN,
        "openai_base_url": completion.url if completion else None,
        "openai_backoff_s": 0.01, "groundedness_threshold": 0.0,
        "fanout_threshold": 0.0,  # route=auto fans every query out unless a test sets one
        "fanout_cache_size": 0,  # tests count the fan-out model's requests; the cache's turn it on
        # admission refuses only a request the estimate says would miss its whole deadline: an
        # outcome a busy machine cannot flip (the admission tests set the estimate themselves)
        "admit_wait_fraction": 1.0,
        # the harness's index, so served answers compare with its own; R4T_INDEX=milvus
        # serves the same catalog from the engine (tests/conftest.py loads it there)
        "index": "milvus" if ENGINE else "bundle",
    }
    return Settings(**{**base, **overrides})


def shipped_settings(bundle: Path, completion: CompletionServer | None, **harness: Any
                     ) -> Settings:
    """`r4t serve`'s settings as shipped: every field at its default in service/settings.py,
    whatever R4T_* the environment holds (R4T_INDEX included), except what a harness must set:
    the bundle, the admin token, the completion endpoint of the AR route (the test bundles have
    no fan-out model of their own) and one ONNX Runtime thread (test workers share the cores).
    Admission, the groundedness gate, the fan-out trigger, the expansion cache, the index and
    the A/B weights stay as a deployment gets them."""
    defaults = {name: field.get_default(call_default_factory=True)
                for name, field in Settings.model_fields.items()}
    return Settings(**{**defaults, "bundle": bundle, "admin_token": ADMIN_TOKEN, "threads": 1,
                       "openai_base_url": completion.url if completion else None, **harness})
