"""`make loadtest`: start `r4t serve` on loopback, run each Locust scenario headless for a
bounded time, and write a summary (JSON, markdown table, PNG latency plot).

Targets 127.0.0.1 only. Scenarios run one after another against one server.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.figure import figure
from loadtest.report import publish
from service.artifacts.bundle import read_manifest
from service.errors import BundleError
from service.loopback import HOST, wait_ready
from service.settings import DEFAULT_BUNDLE

SCENARIOS = ("single", "diffusion", "ar", "mix")
# The rates measured sustainable on 2 cores (server and Locust sharing them); see README.
# `single` (one dense query) comes first, offered twice the rate: the ceiling beside the others.
DEFAULT_SCENARIOS = "single@800,diffusion@400,ar@60,mix@300"
LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def start_server(bundle: Path, port: int, log: Path, prefix: tuple[str, ...] = (),
                 **overrides: str) -> subprocess.Popen:
    """`r4t serve` of `bundle` on loopback (under `prefix`, e.g. taskset); `overrides` are R4T_*
    variables."""
    env = {**os.environ, "R4T_BUNDLE": str(bundle), "R4T_HOST": HOST, "R4T_PORT": str(port),
           "R4T_LOG_LEVEL": "warning", **overrides}
    handle = log.open("w")
    return subprocess.Popen([*prefix, sys.executable, "-m", "service.command", "serve"], env=env,
                            stdout=handle, stderr=subprocess.STDOUT)


def check_bundle(parser: argparse.ArgumentParser, bundle: Path) -> None:
    """A usage error, before any server starts, for a bundle folder that is not one."""
    try:
        read_manifest(bundle)
    except BundleError as exc:
        parser.error(str(exc))


def stop_server(server: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
    if server.poll() is not None:
        return
    server.terminate()
    try:
        server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def batch_totals(port: int) -> dict[str, tuple[float, float]]:
    """Per route, (sum, count) of the server's r4t_batch_size histogram."""
    text = httpx.get(f"http://{HOST}:{port}/metrics", timeout=10.0).text
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("r4t_batch_size_sum", "r4t_batch_size_count"):
                slot = totals.setdefault(sample.labels["route"], [0.0, 0.0])
                slot[sample.name.endswith("_count")] += sample.value
    return {route: (v[0], v[1]) for route, v in totals.items()}


def run_scenario(name: str, port: int, users: int, rate: float, seconds: int, out: Path,
                 order: int = 0) -> dict:
    before = batch_totals(port)
    prefix = out / f"{order}-{name}"
    env = {**os.environ, "R4T_LOAD_SCENARIO": name, "R4T_LOAD_RATE": str(rate / users)}
    subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
         "-u", str(users), "-r", str(users), "-t", f"{seconds}s", "--stop-timeout", "5",
         "--host", f"http://{HOST}:{port}", "--csv", str(prefix), "--exit-code-on-error", "0"],
        env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    summary = summarize(name, prefix, rate, users, seconds)
    after = batch_totals(port)
    summary["mean_batch_size"] = {
        route: (total - before.get(route, (0.0, 0.0))[0])
        / max(count - before.get(route, (0.0, 0.0))[1], 1.0)
        for route, (total, count) in after.items()
    }
    return summary


def summarize(name: str, prefix: Path, rate: float, users: int, seconds: int) -> dict:
    stats = _read_csv(Path(f"{prefix}_stats.csv"))
    failures = _read_csv(Path(f"{prefix}_failures.csv"))
    total = next(r for r in stats if r["Name"] == "/v1/retrieve")
    by_status: dict[str, int] = {}
    for row in failures:
        found = re.search(r"\b([1-5]\d\d)\b", row["Error"])  # "CatchResponseError('429')"
        status = found.group(1) if found else row["Error"][:40]
        by_status[status] = by_status.get(status, 0) + int(row["Occurrences"])
    routes = {r["Name"]: _latency(r) for r in stats if r["Type"] == "ROUTE"}
    refusals = {r["Name"]: _latency(r) for r in stats if r["Type"] == "STATUS"}
    return {
        "scenario": name, "users": users, "offered_rps": rate, "seconds": seconds,
        "requests": int(total["Request Count"]), "failures": int(total["Failure Count"]),
        "failures_by_status": by_status, "throughput_rps": float(total["Requests/s"]),
        "five_xx": sum(n for s, n in by_status.items() if s.startswith("5")),
        "latency_ms": _latency(total), "latency_ms_by_route": routes,
        "latency_ms_by_refusal_status": refusals,
    }


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _latency(row: dict[str, str]) -> dict[str, float]:
    return {p: float(row[f"{p}%"]) if row[f"{p}%"] != "N/A" else float("nan")
            for p in ("50", "95", "99")}


def markdown(results: list[dict]) -> str:
    lines = ["| scenario | offered req/s | requests | throughput req/s | served / offered | "
             "failures by status | mean batch | route | p50 ms | p95 ms | p99 ms |",
             "|---|---:|---:|---:|---:|---|---|---|---:|---:|---:|"]
    for r in results:
        ratio = f"{r['throughput_rps'] / r['offered_rps']:.2f}"
        fails = ", ".join(f"{s}: {n}" for s, n in sorted(r["failures_by_status"].items())) or "0"
        answered = sorted(r["latency_ms_by_route"].items())
        refused = [(f"refused {status}", lat) for status, lat in
                   sorted(r["latency_ms_by_refusal_status"].items())]
        batches = ", ".join(f"{k}: {v:.1f}" for k, v in sorted(r["mean_batch_size"].items()))
        for route, lat in answered + refused:
            lines.append(f"| {r['scenario']} | {r['offered_rps']:.0f} | {r['requests']} | "
                         f"{r['throughput_rps']:.1f} | {ratio} | {fails} | {batches} | {route} | "
                         f"{lat['50']:.0f} | "
                         f"{lat['95']:.0f} | {lat['99']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    labels, values = [], []
    for r in results:
        for route, lat in sorted(r["latency_ms_by_route"].items()):
            labels.append(f"{r['scenario']}\n{route}")
            values.append([lat["50"], lat["95"], lat["99"]])
    with figure(path, (8, 4)) as ax:
        width = 0.25
        for j, name in enumerate(("p50", "p95", "p99")):
            ax.bar([i + (j - 1) * width for i in range(len(labels))], [v[j] for v in values],
                   width, label=name)
        ax.set_xticks(range(len(labels)), labels)
        ax.set(ylabel="ms", title="r4t latency under load (loopback)")
        ax.legend()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--rate", type=float, default=200.0, help="offered requests/s in total")
    parser.add_argument("--seconds", type=int, default=30, help="per scenario")
    parser.add_argument("--scenarios", default=DEFAULT_SCENARIOS,
                        help=f"comma list of {'|'.join(SCENARIOS)}, each optionally "
                        "@<req/s>[:<users>]")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args()
    check_bundle(parser, args.bundle)
    args.out.mkdir(parents=True, exist_ok=True)
    server = start_server(args.bundle, args.port, args.out / "server.log")
    results: list[dict[str, Any]] = []
    try:
        wait_ready(f"http://{HOST}:{args.port}/readyz", process=server)
        for i, spec in enumerate(args.scenarios.split(",")):
            name, _, load = spec.partition("@")  # "mix@800:256": own rate and users
            rate, _, users = load.partition(":")
            results.append(run_scenario(name, args.port, int(users or args.users),
                                        float(rate or args.rate), args.seconds, args.out, i))
    finally:
        stop_server(server)
    plot(results, args.out / "loadtest.png")
    publish(args.out, "loadtest", results, markdown(results))


if __name__ == "__main__":
    main()
