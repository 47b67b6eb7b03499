"""What `make chaos`'s cases share: a server per case on its own port, bundle copies, the
/healthz probe that shows a stopped event loop, and reading the service's metrics."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.openloop import summarize
from loadtest.run import HOST, start_server, stop_server, wait_ready
from service.artifacts.bundle import MANIFEST, read_manifest, write_manifest

ADMIN_TOKEN = "chaos"
RATE = 40.0  # req/s of background load: well under capacity, so failures are the fault's
HEALTHZ_P99_MS = 50.0  # the loop answers liveness during a reload (issue 41, item 4)
HEALTHZ_EVERY_S = 0.01
STEADY_S = 3.0  # seconds of load before a case's judged window: the server's caches warm
ROUND_TRIP_MS = 500.0  # beyond the deadline: the HTTP exchange and a loaded machine's slack
Case = Callable[["Chaos"], dict[str, Any]]


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def statuses(shots: list) -> dict[str, int]:
    return summarize(shots, 1.0, 0.0)["counts_by_status"]


class Chaos:
    """Shared by the cases: the bundle, a port per server, the output folder."""

    def __init__(self, bundle: Path, out: Path, port: int) -> None:
        self.bundle, self.out, self.port = bundle.resolve(), out, port

    @contextmanager
    def server(self, name: str, **env: str) -> Iterator[tuple[str, subprocess.Popen]]:
        self.port += 1
        process = start_server(self.bundle, self.port, self.out / f"{name}.log",
                               R4T_ADMIN_TOKEN=ADMIN_TOKEN, **env)
        try:
            url = f"http://{HOST}:{self.port}"
            wait_ready(f"{url}/readyz", process=process)
            yield url, process
        finally:
            stop_server(process)

    def copy(self, name: str, real: tuple[str, ...] = ()) -> Path:
        """A copy of the bundle beside it (hard links, except the manifest and the files in
        `real`, copied for real), its manifest stamped now: a new version of the same bundle."""
        target = self.bundle.parent / f".chaos-{name}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(self.bundle, target, copy_function=os.link)
        for relative in (MANIFEST, *real):
            (target / relative).unlink()
            shutil.copyfile(self.bundle / relative, target / relative)
        time.sleep(1.0)  # the manifest's stamp has a resolution of a second
        write_manifest(target, read_manifest(target))
        return target

    def clean(self) -> None:
        for copy in self.bundle.parent.glob(".chaos-*"):
            shutil.rmtree(copy, ignore_errors=True)


def reload(url: str, bundle: Path) -> httpx.Response:
    return httpx.post(f"{url}/admin/reload", json={"bundle": str(bundle), "wait": True},
                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=300.0)


def served_version(url: str) -> str:
    return httpx.get(f"{url}/v1/info", timeout=10.0).json()["served"]["bundle"]["version"]


class Liveness:
    """/healthz asked every HEALTHZ_EVERY_S from a thread while the block runs: its latencies
    show whether anything stopped the event loop (a full collection, a blocking close)."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies_ms, self.failures = url, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe, daemon=True)

    def __enter__(self) -> Liveness:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _probe(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while not self._stop.wait(HEALTHZ_EVERY_S):
                started = time.perf_counter()
                try:
                    ok = client.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies_ms.append(1000 * (time.perf_counter() - started))
                self.failures += not ok

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms) or [float("inf")]
        return {"probes": len(self.latencies_ms), "failures": self.failures,
                "p50_ms": round(lat[len(lat) // 2], 1),
                "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1),
                "max_ms": round(lat[-1], 1), "limit_p99_ms": HEALTHZ_P99_MS}


def first_time(predicate: Callable[[], bool], started: float, until: float) -> float | None:
    """Seconds from `started` at which `predicate` first held (polled every 20 ms)."""
    while time.monotonic() < until:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.02)
    return None


def refuses(url: str) -> bool:
    try:
        httpx.get(f"{url}/healthz", timeout=2.0)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def not_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2.0).status_code == 503
    except httpx.HTTPError:
        return True


class Completions(BaseHTTPRequestHandler):
    """A stand-in OpenAI-compatible endpoint: each prompt's query, numbered, as its fan-out;
    `delay_s` makes it slow."""

    delay_s = 0.0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        time.sleep(type(self).delay_s)
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = [{"index": i, "text": "\n".join(
            f"{p.split(chr(10), 1)[0].removeprefix('query: ')} {n}" for n in range(1, 11))}
            for i, p in enumerate(prompts)]
        payload = json.dumps({"choices": choices}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:  # the service gave up waiting (its timeout)
            pass

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def completions(port: int) -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer((HOST, port), Completions)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
