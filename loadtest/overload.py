"""`make overload`: measure the A/B mix's capacity on this machine, offer 4x that (open loop),
then half of it again, and check the promises: refusals are fast 429s, not slow 504s; what is
accepted is answered well inside its deadline; no 5xx; recovery is immediate. The server runs
with the shipped settings. Then a second server, the same but for one fault (a share of every
route's batches stalls, R4T_FAULT_STALL_RATE), takes the same overload: admission must see the
stalls and refuse around them, never admit a request to a 504.

Writes overload.json and overload.md; exits 1 when a promise does not hold.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from loadtest.openloop import Load, scenario_body, summarize
from loadtest.report import publish
from loadtest.run import HOST, check_bundle, start_server, stop_server, wait_ready
from service.arguments import fraction, positive_float
from service.settings import DEFAULT_BUNDLE, Settings

RAMP_START_RPS, RAMP_STEP, RAMP_SECONDS = 60.0, 1.5, 8.0
WARM_S = 8.0  # unjudged load first: a fresh process's first second meets empty caches
LIMITS = {"max_504_share": 0.0, "max_429_p99_ms": 50.0, "max_accepted_p99_share": 0.5}


def phase(url: str, rate: float, seconds: float, seed: int) -> dict[str, Any]:
    shots = Load(url, rate, seconds, scenario_body("mix"), seed=seed).run()
    return summarize(shots, seconds, rate)


def capacity(url: str) -> dict[str, Any]:
    """The most the mix is served per second: offered load grows by RAMP_STEP until the
    service refuses more than 1% or serves under 90% of it; the best served rate is taken."""
    warm = phase(url, RAMP_START_RPS / 2, WARM_S, seed=99)  # caches of a fresh process
    steps = []
    rate = RAMP_START_RPS
    while True:
        step = phase(url, rate, RAMP_SECONDS, seed=len(steps) + 100)
        steps.append(step)
        refused = 1.0 - step["share_by_status"].get("200", 0.0)
        if refused > 0.01 or step["served_rps"] < 0.9 * rate:
            break
        rate *= RAMP_STEP
    best = max(s["served_rps"] for s in steps)
    return {"capacity_rps": best, "warm_up": warm["counts_by_status"],
            "offered_rps": [s["offered_rps"] for s in steps],
            "served_rps": [s["served_rps"] for s in steps], "steps": steps}


def checks(over: dict[str, Any], recovery: dict[str, Any], deadline_ms: float
           ) -> dict[str, dict[str, Any]]:
    """Each promise: the measured value, its limit, and whether it holds."""
    lat = over["latency_ms_by_status"]
    share = over["share_by_status"]
    five_xx = sum(n for s, n in over["counts_by_status"].items()
                  if s.startswith("5") and s != "504")
    results = {  # each (measured, most allowed)
        "504_share": (share.get("504", 0.0), LIMITS["max_504_share"]),
        "429_p99_ms": (lat.get("429", {}).get("99", 0.0), LIMITS["max_429_p99_ms"]),
        "accepted_p99_ms": (lat.get("200", {}).get("99", float("inf")),
                            LIMITS["max_accepted_p99_share"] * deadline_ms),
        "other_5xx": (five_xx, 0),
        "transport_errors": (over["counts_by_status"].get("0", 0), 0),
        "recovery_non_200": (recovery["requests"] - recovery["counts_by_status"].get("200", 0),
                             0),
    }
    return {name: {"value": value, "limit": limit, "holds": bool(value <= limit)}
            for name, (value, limit) in results.items()}


def stall_checks(over: dict[str, Any], deadline_ms: float) -> dict[str, dict[str, Any]]:
    """The overload's promises with stalled batches: no 504, refusals fast, nothing else 5xx."""
    lat, share = over["latency_ms_by_status"], over["share_by_status"]
    five_xx = sum(n for s, n in over["counts_by_status"].items() if s.startswith("5"))
    results = {
        "stalls_504_share": (share.get("504", 0.0), LIMITS["max_504_share"]),
        "stalls_429_p99_ms": (lat.get("429", {}).get("99", 0.0), LIMITS["max_429_p99_ms"]),
        "stalls_accepted_p99_ms": (lat.get("200", {}).get("99", float("inf")), deadline_ms),
        "stalls_5xx": (five_xx, 0),
    }
    return {name: {"value": value, "limit": limit, "holds": bool(value <= limit)}
            for name, (value, limit) in results.items()}


def markdown(report: dict[str, Any]) -> str:
    ramp = report["ramp"]
    lines = [f"Capacity of the A/B mix, the best served rate of a ramp "
             f"(offered {', '.join(f'{r:.0f}' for r in ramp['offered_rps'])} req/s → served "
             f"{', '.join(f'{r:.0f}' for r in ramp['served_rps'])}): "
             f"**{report['capacity_rps']:.1f} req/s**; deadline {report['deadline_ms']:.0f} ms; "
             f"overload at {report['factor']:.0f}x; then again with "
             f"{report['stall']['rate']:.0%} of batches stalled {report['stall']['seconds']:g} s "
             "(injected, a second server).",
             "", "| phase | offered req/s | requests | served req/s | by status | "
             "p50 / p99 ms by status |", "|---|---:|---:|---:|---|---|"]
    phases = [(f"ramp {i + 1}", s) for i, s in enumerate(ramp["steps"])]
    for name, p in [*phases, ("overload", report["overload"]),
                    ("recovery", report["recovery"]),
                    ("overload, stalls", report["overload_with_stalls"])]:
        counts = ", ".join(f"{s}: {n}" for s, n in p["counts_by_status"].items())
        lat = "; ".join(f"{s}: {v['50']:.0f} / {v['99']:.0f}"
                        for s, v in p["latency_ms_by_status"].items())
        lines.append(f"| {name} | {p['offered_rps']:.0f} | {p['requests']} | "
                     f"{p['served_rps']:.1f} | {counts} | {lat} |")
    lines += ["", "| promise | measured | limit | holds |", "|---|---:|---:|---|"]
    for name, c in report["checks"].items():
        lines.append(f"| {name} | {c['value']} | {c['limit']} | {'yes' if c['holds'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--factor", type=positive_float, default=4.0, help="overload, x capacity")
    parser.add_argument("--seconds", type=positive_float, default=30.0, help="per phase")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/overload"))
    parser.add_argument("--stall-rate", type=fraction, default=0.01,
                        help="share of batches that stall in the second overload (0: none)")
    parser.add_argument("--stall-s", type=positive_float, default=2.0, help="a stall's length")
    args = parser.parse_args()
    check_bundle(parser, args.bundle)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline_ms = Settings().request_timeout_ms
    url = f"http://{HOST}:{args.port}"
    server = start_server(args.bundle, args.port, args.out / "server.log")
    try:
        wait_ready(f"{url}/readyz", process=server)
        probe = capacity(url)
        best = max(probe["capacity_rps"], 1.0)
        over = phase(url, args.factor * best, args.seconds, seed=2)
        recovery = phase(url, best / 2, args.seconds / 2, seed=3)
    finally:
        stop_server(server)
    stalled = start_server(args.bundle, args.port, args.out / "server-stalls.log",
                           R4T_FAULT_STALL_RATE=str(args.stall_rate),
                           R4T_FAULT_STALL_S=str(args.stall_s))
    try:
        wait_ready(f"{url}/readyz", process=stalled)
        over_stalls = phase(url, args.factor * best, args.seconds, seed=4)
    finally:
        stop_server(stalled)
    report = {"capacity_rps": best, "factor": args.factor, "deadline_ms": deadline_ms,
              "stall": {"rate": args.stall_rate, "seconds": args.stall_s},
              "ramp": probe, "overload": over, "recovery": recovery,
              "overload_with_stalls": over_stalls,
              "checks": {**checks(over, recovery, deadline_ms),
                         **stall_checks(over_stalls, deadline_ms)},
              "server_exit_code": server.returncode}
    publish(args.out, "overload", report, markdown(report))
    sys.exit(0 if all(c["holds"] for c in report["checks"].values()) else 1)


if __name__ == "__main__":
    main()
