"""`make soak`'s verdict, fed synthetic samples: growth after warm-up of the server's RSS, file
descriptors (its client connections apart) or threads fails it; flat ones, and growth during
warm-up, pass. No server, no timing."""

from __future__ import annotations

import socket
from typing import Any

import psutil
import pytest

from loadtest.soak import (
    MAX_FD_GROWTH,
    MAX_RSS_GROWTH,
    MAX_THREAD_GROWTH,
    WARMUP_SHARE,
    client_connections,
    markdown,
    verdict,
)

SECONDS = 1200.0
OK = {"counts_by_status": {"200": 1000, "429": 3}}


def samples(fds: int = 90, threads: int = 15, rss: float = 850.0, connections: int = 20,
            grow: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """One sample a minute; `grow`: per field, what it has added by the end, linearly after
    warm-up (and a warm-up that climbs, which the verdict must not count)."""
    grow = grow or {}
    start = WARMUP_SHARE * SECONDS
    out = []
    for t in range(0, int(SECONDS) + 1, 60):
        share = max(t - start, 0.0) / (SECONDS - start)
        warming = t < start
        out.append({
            "t_s": float(t),
            "rss_mb": rss * (0.9 if warming else 1.0) + grow.get("rss_mb", 0.0) * share,
            "fds": fds - (30 if warming else 0) + round(grow.get("fds", 0) * share),
            "connections": connections + round(grow.get("connections", 0) * share),
            "threads": threads - (2 if warming else 0) + round(grow.get("threads", 0) * share),
        })
    return out


def test_flat_resources_pass_despite_a_climbing_warm_up() -> None:
    v = verdict(samples(), OK, SECONDS)
    assert v["passed"] and v["failed"] == []
    assert v["fd_growth"] == 0 and v["thread_growth"] == 0 and v["rss_growth"] == 0


def test_growth_within_the_slack_passes() -> None:
    v = verdict(samples(grow={"fds": MAX_FD_GROWTH, "threads": MAX_THREAD_GROWTH}), OK, SECONDS)
    assert v["passed"], v


@pytest.mark.parametrize(("grow", "failed"), [
    ({"fds": MAX_FD_GROWTH + 1}, ["fds"]),
    ({"fds": 26}, ["fds"]),  # the committed run's 89 -> 115, were none of it clients
    ({"threads": MAX_THREAD_GROWTH + 1}, ["threads"]),
    ({"rss_mb": 850.0 * (MAX_RSS_GROWTH + 0.01)}, ["rss"]),
    ({"fds": 40, "threads": 5}, ["fds", "threads"]),
])
def test_growth_past_a_limit_fails_and_says_which(grow: dict[str, float],
                                                  failed: list[str]) -> None:
    v = verdict(samples(grow=grow), OK, SECONDS)
    assert not v["passed"] and v["failed"] == failed
    assert f"NO: {', '.join(failed)}" in markdown(report(v))


def test_descriptors_of_more_client_connections_are_no_leak() -> None:
    v = verdict(samples(grow={"fds": 26, "connections": 26}), OK, SECONDS)
    assert v["passed"] and v["fd_growth"] == 0
    assert (v["fds_after_warmup"], v["fds_final"]) == (90, 116)
    assert (v["connections_after_warmup"], v["connections_final"]) == (20, 46)


def test_samples_without_connections_count_every_descriptor() -> None:
    old = [{k: x for k, x in s.items() if k != "connections"}
           for s in samples(grow={"fds": 26})]
    v = verdict(old, OK, SECONDS)
    assert v["failed"] == ["fds"] and v["connections_final"] is None
    assert "| 90 → 116 | +26 |" in markdown(report(v))


def test_a_status_other_than_200_or_429_fails() -> None:
    v = verdict(samples(), {"counts_by_status": {"200": 10, "503": 1}}, SECONDS)
    assert v["failed"] == ["statuses"] and v["other_statuses"] == {"503": 1}


def test_client_connections_counts_live_sockets_on_the_port_only() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        me = psutil.Process()
        assert client_connections(me, port) == 0  # the listening socket is not a client
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            with accepted:
                assert client_connections(me, port) == 1  # the server's end, not the client's
        assert client.fileno() == -1


def report(v: dict[str, Any]) -> dict[str, Any]:
    latency = {"200": {"50": 80.0, "99": 600.0}}
    return {"minutes": SECONDS / 60, "rate_rps": 127.0, "capacity_rps": 181.0, "verdict": v,
            "summary": {"requests": 1003, **OK, "latency_ms_by_status": latency}}
