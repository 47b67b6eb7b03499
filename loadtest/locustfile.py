"""Locust scenarios against a running r4t service: one route only (single, diffusion, AR), or
the A/B mix.

Select with R4T_LOAD_SCENARIO=single|diffusion|ar|mix; R4T_LOAD_RATE is each user's requests/s
(constant throughput, so users × rate is the offered load). Loopback targets only.
"""

from __future__ import annotations

import os
import random
import time

from locust import FastHttpUser, constant_throughput, task

from loadtest.queries import QUERIES

SCENARIO = os.environ.get("R4T_LOAD_SCENARIO", "mix")
RATE = float(os.environ.get("R4T_LOAD_RATE", "1.0"))


class RetrievalUser(FastHttpUser):
    """geventhttpclient, not requests: one Locust process then offers several times the load
    on a shared core (the overload run needs 4× the service's capacity)."""

    wait_time = constant_throughput(RATE)

    @task
    def retrieve(self) -> None:
        body: dict[str, object] = {"query": random.choice(QUERIES), "k": 10,
                                   "user_id": f"user-{random.randrange(10_000)}"}
        if SCENARIO in ("single", "diffusion", "ar"):
            body["route"] = SCENARIO
        started = time.perf_counter()
        with self.client.post("/v1/retrieve", json=body, name="/v1/retrieve",
                              catch_response=True) as response:
            elapsed_ms = (time.perf_counter() - started) * 1000.0
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}")
                # Refusals get their own latency line: a 429 must be fast, not a slow timeout.
                self._record("STATUS", str(response.status_code), elapsed_ms, response)
                return
            # Record the latency a second time under the route that answered it.
            self._record("ROUTE", response.json().get("route", "unknown"), elapsed_ms, response)

    def _record(self, kind: str, name: str, elapsed_ms: float, response: object) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=name, response_time=elapsed_ms,
            response_length=len(getattr(response, "content", b"") or b""), exception=None,
            context={},
        )
