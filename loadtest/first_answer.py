"""Time to a first answer on a fresh machine: `r4t serve --build` from an empty bundle folder,
one client asking every second, until the diffusion route answers.

Records, from the launch: the first 200, the first answer of each route, and every non-200
after the first answer (none expected: each stage is hot-reloaded, verified, as it lands).
Writes first_answer.json and first_answer.md. Run alone: the build is the whole offline job.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.report import publish
from service.settings import DEFAULT_BUNDLE

QUERY = {"query": "musical instrument", "k": 10}


def probe(client: httpx.Client) -> tuple[int, str | None]:
    try:
        response = client.post("/v1/retrieve", json=QUERY)
    except httpx.TransportError:
        return 0, None  # not listening yet
    route = response.json().get("route") if response.status_code == 200 else None
    return response.status_code, route


def watch(url: str, started: float, limit_s: float, period_s: float) -> list[dict[str, Any]]:
    """One request per period until diffusion answers or the limit passes."""
    log: list[dict[str, Any]] = []
    with httpx.Client(base_url=url, timeout=30.0) as client:
        while time.monotonic() - started < limit_s:
            status, route = probe(client)
            log.append({"t_s": round(time.monotonic() - started, 2), "status": status,
                        "route": route})
            if route == "diffusion":
                break
            time.sleep(period_s)
    return log


def summary(log: list[dict[str, Any]]) -> dict[str, Any]:
    answered = [e for e in log if e["status"] == 200]
    first = answered[0]["t_s"] if answered else None
    routes: dict[str, float] = {}
    for entry in answered:
        routes.setdefault(entry["route"], entry["t_s"])
    after = [e for e in log if first is not None and e["t_s"] >= first]
    return {"first_answer_s": first, "first_answer_by_route_s": routes,
            "requests_after_first_answer": len(after),
            "failed_after_first_answer": [e for e in after if e["status"] != 200],
            "requests": len(log)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--limit-min", type=float, default=180.0,
                        help="give up after this many minutes")
    parser.add_argument("--period-s", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args()
    started = time.monotonic()
    command = [sys.executable, "-m", "training.cli", "--bundle", str(args.bundle), "serve",
               "--build", "--port", str(args.port)]
    server = subprocess.Popen(command)
    try:
        log = watch(f"http://127.0.0.1:{args.port}", started, 60 * args.limit_min, args.period_s)
    finally:
        server.terminate()
        server.wait(timeout=60)
    report = {"command": " ".join(command), **summary(log), "log": log}
    lines = ["# First answer from an empty bundle (`r4t serve --build`)", "",
             f"- first answer: {report['first_answer_s']} s after launch",
             *(f"- first `{route}` answer: {t} s"
               for route, t in report["first_answer_by_route_s"].items()),
             f"- requests after the first answer: {report['requests_after_first_answer']}, "
             f"failed: {len(report['failed_after_first_answer'])}"]
    publish(args.out, "first_answer", report, "\n".join(lines))


if __name__ == "__main__":
    main()
