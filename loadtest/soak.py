"""`make soak`: the A/B mix at ~70% of this machine's measured capacity for SOAK_MINUTES
(default 20), open loop, sampling the server every 10 s: RSS, open file descriptors, threads,
queue depth per route, requests by status. Fails when, after warm-up, RSS grows more than 5%,
the file descriptors not held by a client's connection grow by more than MAX_FD_GROWTH, or the
threads by more than MAX_THREAD_GROWTH, or when any request gets a status other than 200 or 429.

Writes soak.json, soak.md and soak.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from loadtest.figure import figure
from loadtest.openloop import Load, scenario_body, summarize
from loadtest.overload import capacity
from loadtest.report import publish
from loadtest.run import HOST, check_bundle, start_server, stop_server, wait_ready
from service.arguments import positive_float
from service.settings import DEFAULT_BUNDLE

LOAD_SHARE = 0.7
MAX_RSS_GROWTH = 0.05
# a few descriptors opened once after warm-up (a lazily opened file) are no leak; a leak adds one
# per request, batch, reload or departed client: hundreds over a 20-minute run
MAX_FD_GROWTH = 8
# a pool may start a worker or two on demand (asyncio's default executor); a leak adds one per
# request, batch or reload
MAX_THREAD_GROWTH = 2
WARMUP_SHARE = 0.15  # the first 15% of the run (3 of 20 minutes) is warm-up
ALLOWED = {"200", "429"}


def server_sample(process: psutil.Process, url: str) -> dict[str, Any]:
    """What the `r4t serve` process holds now; `connections`: its open sockets to clients, apart,
    since the open-loop client keeps as many alive as its busiest moment needed."""
    queue: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "r4t_queue_depth":
                queue[sample.labels["route"]] = sample.value
    with process.oneshot():
        return {"rss_mb": round(process.memory_info().rss / 2**20, 1),
                "fds": process.num_fds(),
                "connections": client_connections(process, urlsplit(url).port or 80),
                "threads": process.num_threads(), "queue_depth": queue}


def client_connections(process: psutil.Process, port: int) -> int:
    """Live client sockets on `port`, the client's keep-alive pool and no leak (CLOSE_WAIT and
    outbound sockets are left out, so a leak of them still counts)."""
    return sum(1 for c in process.net_connections(kind="tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)


def soak(url: str, pid: int, rate: float, seconds: float, every_s: float) -> dict[str, Any]:
    process = psutil.Process(pid)
    load = Load(url, rate, seconds, scenario_body("mix"), seed=11).start()
    samples = []
    stop_at = time.monotonic() + seconds
    while time.monotonic() < stop_at:
        time.sleep(min(every_s, max(stop_at - time.monotonic(), 0.0)))
        shots = list(load.shots)
        counts: dict[str, int] = {}
        for shot in shots:
            counts[str(shot.status)] = counts.get(str(shot.status), 0) + 1
        samples.append({"t_s": round(time.monotonic() - load.started, 1),
                        **server_sample(process, url), "requests_by_status": counts})
        last = samples[-1]
        print(f"soak t={last['t_s']:.0f}s rss={last['rss_mb']} MB fds={last['fds']} "
              f"(clients {last['connections']}) threads={last['threads']} {counts}", flush=True)
    shots = load.join()
    return {"samples": samples, "summary": summarize(shots, seconds, rate)}


def other_fds(sample: dict[str, Any]) -> int:
    """Descriptors a leak would hold: all but the sockets of connected clients (a sample from
    before `connections` was recorded counts every descriptor)."""
    return int(sample["fds"]) - int(sample.get("connections", 0))


def ends(warm: list[dict[str, Any]], value: Callable[[dict[str, Any]], float]
         ) -> tuple[float, float]:
    """After warm-up: the first sample's value and the end's, the highest of the last 3 (one quiet
    sample at the end hides no growth)."""
    return value(warm[0]), max(value(s) for s in warm[-3:])


def verdict(samples: list[dict[str, Any]], summary: dict[str, Any], seconds: float
            ) -> dict[str, Any]:
    """Growth after warm-up of RSS (relative), fds and threads (absolute), and the statuses."""
    warm = [s for s in samples if s["t_s"] >= WARMUP_SHARE * seconds] or samples
    rss = ends(warm, lambda s: s["rss_mb"])
    fds, others = ends(warm, lambda s: s["fds"]), ends(warm, other_fds)
    clients = ends(warm, lambda s: s["connections"]) if "connections" in warm[0] else (None, None)
    threads = ends(warm, lambda s: s["threads"])
    rss_growth = (rss[1] - rss[0]) / rss[0]
    fd_growth, thread_growth = others[1] - others[0], threads[1] - threads[0]
    bad = {s: n for s, n in summary["counts_by_status"].items() if s not in ALLOWED}
    failed = [name for name, over in (
        ("rss", rss_growth > MAX_RSS_GROWTH), ("fds", fd_growth > MAX_FD_GROWTH),
        ("threads", thread_growth > MAX_THREAD_GROWTH), ("statuses", bool(bad))) if over]
    return {"rss_after_warmup_mb": rss[0], "rss_final_mb": rss[1],
            "rss_growth": round(rss_growth, 4), "max_rss_growth": MAX_RSS_GROWTH,
            "fds_after_warmup": fds[0], "fds_final": fds[1],
            "connections_after_warmup": clients[0], "connections_final": clients[1],
            "fd_growth": fd_growth, "max_fd_growth": MAX_FD_GROWTH,
            "threads_after_warmup": threads[0], "threads_final": threads[1],
            "thread_growth": thread_growth, "max_thread_growth": MAX_THREAD_GROWTH,
            "other_statuses": bad, "failed": failed, "passed": not failed}


def plot(samples: list[dict[str, Any]], path: Path) -> None:
    t = [s["t_s"] / 60 for s in samples]
    with figure(path, (9, 4)) as ax:
        ax.plot(t, [s["rss_mb"] for s in samples], label="RSS (MB)")
        ax.plot(t, [s["fds"] for s in samples], label="open fds")
        ax.plot(t, [s.get("connections", 0) for s in samples], label="client connections")
        ax.plot(t, [s["threads"] for s in samples], label="threads")
        ax.plot(t, [sum(s["queue_depth"].values()) for s in samples], label="queue depth")
        ax.set(xlabel="minutes", title="r4t soak: the A/B mix at 70% of capacity")
        ax.legend()


def markdown(report: dict[str, Any]) -> str:
    """One row: what the verdict read (after warm-up → end), its limits, and what failed."""
    v, s = report["verdict"], report["summary"]
    lat = "; ".join(f"{k}: {x['50']:.0f} / {x['99']:.0f}"
                    for k, x in s["latency_ms_by_status"].items())
    passed = "yes" if v["passed"] else "NO: " + ", ".join(v["failed"])
    fds = [f"{v['fds_' + when]}" if v["connections_" + when] is None
           else f"{v['fds_' + when]} ({v['connections_' + when]})"
           for when in ("after_warmup", "final")]
    return "\n".join([
        f"Soak: {report['minutes']:.0f} min of the A/B mix at {report['rate_rps']:.0f} req/s "
        f"({LOAD_SHARE:.0%} of the measured capacity, {report['capacity_rps']:.0f} req/s). "
        f"After warm-up → end; limits: RSS +{v['max_rss_growth']:.0%}, fds other than client "
        f"connections +{v['max_fd_growth']}, threads +{v['max_thread_growth']}.", "",
        "| requests | by status | p50 / p99 ms | RSS | growth | fds (client connections) | "
        "other fds growth | threads | passed |", "|---:|---|---|---|---:|---|---:|---|---|",
        f"| {s['requests']} | {s['counts_by_status']} | {lat} | {v['rss_after_warmup_mb']} → "
        f"{v['rss_final_mb']} MB | {v['rss_growth']:.1%} | {fds[0]} → {fds[1]} | "
        f"{v['fd_growth']:+} | {v['threads_after_warmup']} → {v['threads_final']} | {passed} |",
        ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--port", type=int, default=8767)
    parser.add_argument("--minutes", type=positive_float, default=20.0)
    parser.add_argument("--every", type=positive_float, default=10.0,
                        help="seconds between samples")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/soak"))
    args = parser.parse_args()
    check_bundle(parser, args.bundle)
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://{HOST}:{args.port}"
    server = start_server(args.bundle, args.port, args.out / "server.log")
    try:
        wait_ready(f"{url}/readyz", process=server)
        best = max(capacity(url)["capacity_rps"], 1.0)
        seconds = args.minutes * 60
        result = soak(url, server.pid, LOAD_SHARE * best, seconds, args.every)
    finally:
        stop_server(server)
    report = {"minutes": args.minutes, "capacity_rps": best,
              "rate_rps": round(LOAD_SHARE * best, 1), **result,
              "verdict": verdict(result["samples"], result["summary"], seconds)}
    publish(args.out, "soak", report, markdown(report))
    plot(result["samples"], args.out / "soak.png")
    sys.exit(0 if report["verdict"]["passed"] else 1)


if __name__ == "__main__":
    main()
