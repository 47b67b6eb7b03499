"""`make wrk`'s driver: wrk.lua's summary is read back whole against a live service, and its
clients honor a 429's Retry-After (or, asked to, ignore it) against a server that refuses all."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from loadtest.wrk import drive, layers, reaped_cpu, run_wrk, wrk_result
from tests.prerequisites import needs
from tests.service.live import live_server, make_settings

pytestmark = needs("wrk", package="Debian's wrk package (make system-deps, .ci/run)")


def test_a_short_wrk_run_is_counted_whole(small_bundle_dir: Path, tmp_path: Path) -> None:
    settings = make_settings(small_bundle_dir, None, index="bundle")
    with live_server(settings) as server:
        port = int(server.url.rsplit(":", 1)[1])
        row = drive([port], [os.getpid()], "single", connections=4, seconds=1, out_dir=tmp_path)
    assert row["requests"] > 0 and row["socket_errors"] == 0
    assert row["statuses"] == {"200": row["requests"]}
    assert row["answered_rps"] == pytest.approx(row["rps"])
    assert 0 < row["latency_ms"]["50"] <= row["latency_ms"]["99"]
    assert row["mean_batch"]["single"] >= 1.0
    assert row["generator_cpu_ms_per_request"] > 0  # wrk's own usage, from os.wait4


class Refusing(BaseHTTPRequestHandler):
    """Every request: 429 with Retry-After 1; counts what it was sent."""

    protocol_version = "HTTP/1.1"
    seen = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        with Refusing.lock:
            Refusing.seen += 1
        self.send_response(429)
        self.send_header("Retry-After", "1")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def refusing_server() -> Iterator[int]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("clients", ["honor", "ignore"])
def test_clients_honor_retry_after_or_ignore_it(clients: str, tmp_path: Path) -> None:
    """Two connections for 2 s: honoring, each waits 1 s after every 429 (at most 2 requests
    per connection); ignoring, they send again at once."""
    Refusing.seen = 0
    with refusing_server() as port:
        process = run_wrk(port, "diffusion", 2, 2, clients, tmp_path / "wrk.txt")
        reaped_cpu(process, 60)
    result = wrk_result(tmp_path / "wrk.txt")
    assert result["statuses"] == {"429": result["requests"]}
    if clients == "honor":
        assert 2 <= result["requests"] <= 6
    else:
        assert result["requests"] > 50


def test_profile_layers_are_shares_of_the_leaf_frames(tmp_path: Path) -> None:
    stacks = tmp_path / "profile.txt"
    stacks.write_text(
        "run (uvicorn/server.py:1);search (faiss/__init__.py:9) 6\n"
        "run (uvicorn/server.py:1);answer (service/routes/single.py:3) 3\n"
        "run (uvicorn/server.py:1) 1\n")
    assert layers(stacks) == {"FAISS": 0.6, "r4t service code": 0.3,
                              "uvicorn + httptools": 0.1}
