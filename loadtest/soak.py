"""`make soak`: the A/B mix at ~70% of this machine's measured capacity for SOAK_MINUTES
(default 20), open loop, sampling the server every 10 s: RSS, open file descriptors, threads,
queue depth per route, requests by status. Fails when RSS grows more than 5% after warm-up or
any request gets a status other than 200 or 429.

Writes soak.json, soak.md and soak.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

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
WARMUP_SHARE = 0.15  # the first 15% of the run (3 of 20 minutes) is warm-up
ALLOWED = {"200", "429"}


def server_sample(process: psutil.Process, url: str) -> dict[str, Any]:
    """What the server holds now (the `r4t serve` process and its children, if any)."""
    queue: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "r4t_queue_depth":
                queue[sample.labels["route"]] = sample.value
    with process.oneshot():
        return {"rss_mb": round(process.memory_info().rss / 2**20, 1),
                "fds": process.num_fds(), "threads": process.num_threads(),
                "queue_depth": queue}


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
        print(f"soak t={samples[-1]['t_s']:.0f}s rss={samples[-1]['rss_mb']} MB "
              f"fds={samples[-1]['fds']} threads={samples[-1]['threads']} {counts}", flush=True)
    shots = load.join()
    return {"samples": samples, "summary": summarize(shots, seconds, rate)}


def verdict(samples: list[dict[str, Any]], summary: dict[str, Any], seconds: float
            ) -> dict[str, Any]:
    warm = [s for s in samples if s["t_s"] >= WARMUP_SHARE * seconds] or samples
    baseline, final = warm[0]["rss_mb"], max(s["rss_mb"] for s in warm[-3:])
    growth = (final - baseline) / baseline
    bad = {s: n for s, n in summary["counts_by_status"].items() if s not in ALLOWED}
    return {"rss_after_warmup_mb": baseline, "rss_final_mb": final,
            "rss_growth": round(growth, 4), "max_rss_growth": MAX_RSS_GROWTH,
            "fds_after_warmup": warm[0]["fds"], "fds_final": warm[-1]["fds"],
            "threads_after_warmup": warm[0]["threads"], "threads_final": warm[-1]["threads"],
            "other_statuses": bad, "passed": growth <= MAX_RSS_GROWTH and not bad}


def plot(samples: list[dict[str, Any]], path: Path) -> None:
    t = [s["t_s"] / 60 for s in samples]
    with figure(path, (9, 4)) as ax:
        ax.plot(t, [s["rss_mb"] for s in samples], label="RSS (MB)")
        ax.plot(t, [s["fds"] for s in samples], label="open fds")
        ax.plot(t, [s["threads"] for s in samples], label="threads")
        ax.plot(t, [sum(s["queue_depth"].values()) for s in samples], label="queue depth")
        ax.set(xlabel="minutes", title="r4t soak: the A/B mix at 70% of capacity")
        ax.legend()


def markdown(report: dict[str, Any]) -> str:
    v, s = report["verdict"], report["summary"]
    lat = "; ".join(f"{k}: {x['50']:.0f} / {x['99']:.0f}"
                    for k, x in s["latency_ms_by_status"].items())
    return "\n".join([
        f"Soak: {report['minutes']:.0f} min of the A/B mix at {report['rate_rps']:.0f} req/s "
        f"({LOAD_SHARE:.0%} of the measured capacity, {report['capacity_rps']:.0f} req/s).", "",
        "| requests | by status | p50 / p99 ms | RSS after warm-up → end | growth | fds | "
        "threads | passed |", "|---:|---|---|---|---:|---|---|---|",
        f"| {s['requests']} | {s['counts_by_status']} | {lat} | {v['rss_after_warmup_mb']} → "
        f"{v['rss_final_mb']} MB | {v['rss_growth']:.1%} | {v['fds_after_warmup']} → "
        f"{v['fds_final']} | {v['threads_after_warmup']} → {v['threads_final']} | "
        f"{'yes' if v['passed'] else 'NO'} |", ""])


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
        wait_ready(args.port, server=server)
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
