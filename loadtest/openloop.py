"""An open-loop load generator: requests leave on a fixed schedule whatever the answers, as
vegeta's or k6's constant arrival rate, so an overloaded service cannot slow the offered load
down, and each latency counts from when its request was due (no coordinated omission).

Hand-written (on aiohttp) because no open-loop generator installs from the registries here:
Locust and Debian's `hey` are closed-loop (a user waits for its answer before the next request,
so at 4x capacity most users sit blocked and the offered load collapses), vegeta and k6 are not
packaged. `Load` runs in a thread of its own so that a scenario can act while it fires.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from loadtest.queries import QUERIES

TRANSPORT_ERROR = 0  # the status recorded when no HTTP answer came (refused, reset, timeout)
Body = Callable[[random.Random], dict[str, Any]]


def scenario_body(scenario: str) -> Body:
    """Request bodies of a scenario: one route forced, or the A/B mix (route chosen by the
    service from a random user id), over varied broad queries."""

    def body(rng: random.Random) -> dict[str, Any]:
        request: dict[str, Any] = {"query": rng.choice(QUERIES), "k": 10,
                                   "user_id": f"user-{rng.randrange(10_000)}"}
        if scenario != "mix":
            request["route"] = scenario
        return request

    return body


@dataclass(frozen=True)
class Shot:
    due: float  # seconds from the start of the run at which the request was scheduled
    status: int  # HTTP status, or TRANSPORT_ERROR
    latency_s: float  # from `due` to the whole answer
    route: str | None = None  # the route that answered a 200


@dataclass
class Load:
    """`rate` requests/s to `url` for `seconds` (or until `stop()`), in a background thread."""

    url: str
    rate: float
    seconds: float
    body: Body
    timeout_s: float = 10.0
    seed: int = 0
    shots: list[Shot] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    started: float = 0.0  # time.monotonic() of the first due time

    def start(self) -> Load:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._fire()), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self) -> list[Shot]:
        assert self._thread is not None, "start() first"
        self._thread.join()
        return self.shots

    def run(self) -> list[Shot]:
        return self.start().join()

    async def _fire(self) -> None:
        rng = random.Random(self.seed)
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self.started = time.monotonic()
            pending: set[asyncio.Task] = set()
            n = 0
            while not self._stop.is_set():
                due = n / self.rate
                if due >= self.seconds:
                    break
                delay = self.started + due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(self._one(session, due, self.body(rng)))
                pending.add(task)
                task.add_done_callback(pending.discard)
                n += 1
            if pending:
                await asyncio.wait(pending)

    async def _one(self, session: aiohttp.ClientSession, due: float, body: dict) -> None:
        route = None
        try:
            async with session.post(f"{self.url}/v1/retrieve", json=body) as response:
                payload = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError, OSError):
            status = TRANSPORT_ERROR
        if status == 200:
            try:
                route = json.loads(payload).get("route")
            except (ValueError, AttributeError):
                route = "unparsable"
        self.shots.append(Shot(due, status, time.monotonic() - self.started - due, route))


def percentiles(latencies: list[float]) -> dict[str, float]:
    if not latencies:
        return {"50": float("nan"), "95": float("nan"), "99": float("nan"), "n": 0}
    ms = np.asarray(latencies) * 1000.0
    return {p: round(float(np.percentile(ms, int(p))), 1) for p in ("50", "95", "99")} | {
        "n": len(latencies)}


def summarize(shots: list[Shot], seconds: float, offered_rps: float) -> dict[str, Any]:
    """Counts by status; latency by status and by answering route; rates per second."""
    by_status: dict[str, list[float]] = {}
    by_route: dict[str, list[float]] = {}
    for shot in shots:
        by_status.setdefault(str(shot.status), []).append(shot.latency_s)
        if shot.route is not None:
            by_route.setdefault(shot.route, []).append(shot.latency_s)
    counts = {status: len(v) for status, v in sorted(by_status.items())}
    answered = len(shots)
    return {
        "offered_rps": offered_rps, "seconds": seconds, "requests": answered,
        "counts_by_status": counts,
        "served_rps": round(counts.get("200", 0) / seconds, 1),
        "share_by_status": {s: round(n / max(answered, 1), 4) for s, n in counts.items()},
        "latency_ms_by_status": {s: percentiles(v) for s, v in sorted(by_status.items())},
        "latency_ms_by_route": {r: percentiles(v) for r, v in sorted(by_route.items())},
    }
