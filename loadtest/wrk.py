"""`make wrk`: the service at the HTTP stack's limit, driven by wrk (Debian's `wrk`, compiled C
with LuaJIT), closed loop with C connections.

Per scenario (single, diffusion, ar, the A/B mix): responses and answers (200s) per second,
latency, statuses, the mean batch, and the CPU the server and the generator each spent per
response, so a table says whether the generator or the server held the cores. Each scenario
starts once the server has nothing in flight. Beside them, in the same run:
- Locust (the `make loadtest` generator) offered far more `single` than it can send: its
  throughput and CPU per response against wrk's, on the same server;
- with `--processes 2`, two `r4t serve` processes side by side, each pinned to its own core
  (`taskset`, `R4T_THREADS=1`: a one-core replica), each driven by half the connections;
- with `--profile`, one more pass per scenario, not timed, while py-spy samples the server:
  self time by library.
Writes `wrk.json` and `wrk.md` (and `profile-<scenario>.txt`, py-spy's collapsed stacks).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from loadtest.queries import QUERIES
from loadtest.report import publish
from loadtest.run import (
    HOST,
    SCENARIOS,
    batch_totals,
    check_bundle,
    run_scenario,
    start_server,
    stop_server,
    wait_ready,
)
from service.arguments import positive, positive_list
from service.settings import DEFAULT_BUNDLE

SCRIPT = Path(__file__).with_name("wrk.lua")
PY_SPY = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:/usr/bin:/usr/local/bin")
LOCUST_OFFERED_RPS = 4000  # far past what one Locust process sends on these cores
# py-spy's leaf frames, by file path, to the layer that spent the time (first match wins)
LAYERS = (("onnxruntime", "ONNX Runtime"), ("faiss", "FAISS"), ("numpy", "numpy"),
          ("wordllama", "encoder (WordLlama)"), ("tokenizers", "tokenizers"),
          ("pydantic", "pydantic"), ("starlette", "Starlette/FastAPI"),
          ("fastapi", "Starlette/FastAPI"), ("uvicorn", "uvicorn + httptools"),
          ("httptools", "uvicorn + httptools"), ("prometheus_client", "Prometheus metrics"),
          ("logging", "logging"), ("json", "json"), ("asyncio", "asyncio event loop"),
          ("threading", "threads (hand-offs)"), ("concurrent", "threads (hand-offs)"),
          ("service/", "r4t service code"))


def run_wrk(port: int, scenario: str, connections: int, seconds: int, clients: str,
            out: Path) -> subprocess.Popen:
    """Start wrk against one server, its output into `out`. `clients`: "honor" waits out a
    429's Retry-After (one connection per wrk thread, so the pause is that client's), "ignore"
    sends again at once (2 threads)."""
    threads = connections if clients == "honor" else min(2, connections)
    command = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s",
               "-s", str(SCRIPT), f"http://{HOST}:{port}", "--", scenario, clients, *QUERIES]
    with out.open("w") as handle:
        return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT)


def wrk_result(out: Path) -> dict[str, Any]:
    """The JSON line wrk.lua's done() printed."""
    lines = [line for line in out.read_text().splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"wrk printed no summary:\n{out.read_text()[-2000:]}")
    return json.loads(lines[-1])


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of the server processes (all their threads)."""
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reaped_cpu(process: subprocess.Popen, timeout_s: float) -> float:
    """Wait for `process` and return its own CPU seconds (os.wait4's usage: the generator's
    alone, whatever else this process started and reaped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        time.sleep(0.1)
    process.kill()
    raise TimeoutError(f"wrk did not finish within {timeout_s:.0f} s")


def in_flight(port: int) -> float:
    text = httpx.get(f"http://{HOST}:{port}/metrics", timeout=10.0).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "r4t_in_flight")


def wait_idle(ports: list[int], timeout_s: float = 60.0) -> None:
    """Until no server has a request in flight: the last scenario's tail is not this one's."""
    deadline = time.monotonic() + timeout_s
    while any(in_flight(port) for port in ports):
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests still in flight after {timeout_s:.0f} s")
        time.sleep(0.2)


def profile(port: int, pid: int, scenario: str, connections: int, seconds: int,
            out_dir: Path) -> dict[str, float]:
    """A pass of `scenario` (not timed) while py-spy samples the server: layers' shares."""
    wait_idle([port])
    spied = out_dir / f"profile-{scenario}.txt"
    spy = subprocess.Popen([PY_SPY, "record", "--pid", str(pid), "--duration", str(seconds),
                            "--rate", "100", "--format", "raw", "--nonblocking", "--output",
                            str(spied)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run = run_wrk(port, scenario, connections, seconds, "honor",
                  out_dir / f"wrk-{scenario}-profiled.txt")
    run.wait(timeout=seconds + 60)
    output, _ = spy.communicate(timeout=seconds + 60)
    if spy.returncode != 0 or not spied.is_file():
        raise RuntimeError(f"py-spy failed ({spy.returncode}): {output.decode()[-1000:]}")
    return layers(spied)


def layers(path: Path) -> dict[str, float]:
    """Share of samples per layer, by each stack's leaf frame (self time)."""
    counts: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        layer = next((name for key, name in LAYERS if key in leaf), "other (Python, C)")
        counts[layer] += int(count)
    total = sum(counts.values()) or 1
    return {name: round(n / total, 3) for name, n in counts.most_common()}


def drive(ports: list[int], pids: list[int], scenario: str, connections: int, seconds: int,
          out_dir: Path, clients: str = "honor") -> dict[str, Any]:
    """One wrk per server, `connections` shared among them, all at once, from an idle
    server."""
    wait_idle(ports)
    before_batch = [batch_totals(p) for p in ports]
    server_before = cpu_seconds(pids)
    share = max(connections // len(ports), 1)
    outs = [out_dir / f"wrk-{scenario}-{clients}-{len(ports)}p-{port}.txt" for port in ports]
    runs = [run_wrk(port, scenario, share, seconds, clients, out)
            for port, out in zip(ports, outs, strict=True)]
    gen_cpu = sum(reaped_cpu(process, seconds + 60) for process in runs)
    server_cpu = cpu_seconds(pids) - server_before
    results = [wrk_result(out) for out in outs]
    requests = sum(r["requests"] for r in results)
    duration = max(r["duration_us"] for r in results) / 1e6
    statuses: Counter[str] = Counter()
    for r in results:
        statuses.update(r["statuses"])
    row = {"generator": "wrk", "clients": clients, "scenario": scenario,
           "processes": len(ports), "connections": connections, "requests": requests,
           "rps": requests / duration, "answered_rps": statuses.get("200", 0) / duration,
           "statuses": dict(statuses), "socket_errors": sum(sum(r["errors"].values())
                                                            for r in results),
           "latency_ms": worst(results), "server_cpu_ms_per_request": 1000 * server_cpu
           / max(requests, 1), "generator_cpu_ms_per_request": 1000 * gen_cpu / max(requests, 1),
           "mean_batch": mean_batches(before_batch, [batch_totals(p) for p in ports])}
    return row


def worst(results: list[dict[str, Any]]) -> dict[str, float]:
    """Per percentile, the worse of the servers' (one server: its own)."""
    return {p: max(r["latency_ms"][p] for r in results) for p in ("50", "90", "99")}


def mean_batches(before: list[dict], after: list[dict]) -> dict[str, float]:
    sums: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for old, new in zip(before, after, strict=True):
        for route, (total, count) in new.items():
            sums[route] += total - old.get(route, (0.0, 0.0))[0]
            counts[route] += count - old.get(route, (0.0, 0.0))[1]
    return {route: round(sums[route] / counts[route], 1) for route in sums if counts[route]}


def locust_row(port: int, pid: int, connections: int, seconds: int, out: Path) -> dict[str, Any]:
    """`make loadtest`'s generator offered far more `single` than it sends, same server."""
    wait_idle([port])
    server_before, gen_before = cpu_seconds([pid]), children_cpu()
    summary = run_scenario("single", port, connections, LOCUST_OFFERED_RPS, seconds, out, 99)
    server_cpu, gen_cpu = cpu_seconds([pid]) - server_before, children_cpu() - gen_before
    requests = summary["requests"]
    return {"generator": "locust", "clients": "paced", "scenario": "single", "processes": 1,
            "connections": connections, "requests": requests, "rps": summary["throughput_rps"],
            "answered_rps": summary["throughput_rps"] * (requests - summary["failures"])
            / max(requests, 1),
            "statuses": {"200": requests - summary["failures"], **summary["failures_by_status"]},
            "socket_errors": 0, "latency_ms": {"50": summary["latency_ms"]["50"], "90": None,
                                              "99": summary["latency_ms"]["99"]},
            "server_cpu_ms_per_request": 1000 * server_cpu / max(requests, 1),
            "generator_cpu_ms_per_request": 1000 * gen_cpu / max(requests, 1),
            "mean_batch": summary["mean_batch_size"]}


def bundle_note(bundle: Path) -> str:
    """Which bundle was served: its diffusion and fan-out stages' sizes decide the paths' cost."""
    def config(name: str) -> dict[str, Any]:
        path = bundle / name
        return json.loads(path.read_text()) if path.is_file() else {}

    diffusion, folm = config("diffusion/diffusion.json"), config("folm/folm.json")
    context = diffusion.get("context", 0)
    attends = f"context {context} ({diffusion.get('context_source')})" if context else \
        "no context"
    return (f"`{bundle}`: denoiser {diffusion.get('params', 0):,} parameters, {attends}, "
            f"{diffusion.get('draws', 1)} draws; fan-out model {folm.get('params', 0):,} "
            "parameters")


def markdown(rows: list[dict[str, Any]], cpu: str, bundle: str,
             profiles: dict[str, dict[str, float]] | None = None) -> str:
    lines = [f"Closed loop on loopback, {cpu}; the generator shares the cores with the server.",
             f"Bundle {bundle}.",
             "Clients: `honor` wait out a 429's Retry-After, `ignore` send again at once; "
             "Locust's are paced to an offered rate past what it can send. Two processes: each "
             "pinned to its own core, `R4T_THREADS=1`. Latency and CPU are per response, 429s "
             "included; answered/s counts 200s.",
             "", "| generator | clients | scenario | processes | connections | responses/s | "
             "answered/s | statuses | p50 ms | p90 ms | p99 ms | server CPU ms/resp | "
             "generator CPU ms/resp | mean batch |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lat = r["latency_ms"]
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(r["statuses"].items()))
        batches = ", ".join(f"{k}: {v:.1f}" for k, v in sorted(r["mean_batch"].items()) if v)
        p90 = "–" if lat["90"] is None else f"{lat['90']:.0f}"
        lines.append(f"| {r['generator']} | {r['clients']} | {r['scenario']} | {r['processes']} | "
                     f"{r['connections']} | {r['rps']:.0f} | {r['answered_rps']:.0f} | "
                     f"{statuses} | {lat['50']:.0f} | "
                     f"{p90} | {lat['99']:.0f} | {r['server_cpu_ms_per_request']:.2f} | "
                     f"{r['generator_cpu_ms_per_request']:.2f} | {batches} |")
    if profiles:
        lines += ["", "Server self time by layer (py-spy at 100 Hz over a separate, untimed pass "
                  "of honoring clients, one process; leaf frames, share of samples):", ""]
        for scenario, shares in profiles.items():
            text = ", ".join(f"{k} {v:.0%}" for k, v in shares.items() if v >= 0.01)
            lines.append(f"- {scenario}: {text}")
    return "\n".join(lines) + "\n"


def serve(bundle: Path, port: int, log: Path, core: int | None) -> subprocess.Popen:
    """`r4t serve` ready on `port`; with a `core`, pinned to it with one compute thread."""
    pinned = {"R4T_THREADS": "1"} if core is not None else {}
    prefix = ("taskset", "-c", str(core)) if core is not None else ()
    server = start_server(bundle, port, log, prefix, **pinned)
    try:
        wait_ready(f"http://{HOST}:{port}/readyz", process=server)
    except BaseException:
        stop_server(server)
        raise
    return server


def measure(args: argparse.Namespace, processes: int, rows: list[dict[str, Any]],
            profiles: dict[str, dict[str, float]]) -> None:
    """Every scenario against `processes` servers (past one, each on its own core), then,
    with one, Locust's row and the profiling passes."""
    ports = [args.port + i for i in range(processes)]
    servers: list[subprocess.Popen] = []
    try:
        for i, port in enumerate(ports):
            core = i % os.cpu_count() if processes > 1 else None
            servers.append(serve(args.bundle, port, args.out / f"server-{port}.log", core))
        pids = [s.pid for s in servers]
        kinds = args.clients if processes == 1 else args.clients[:1]
        for clients in kinds:
            for scenario in args.scenarios.split(","):
                rows.append(drive(ports, pids, scenario, args.connections, args.seconds,
                                  args.out, clients))
                print(json.dumps(rows[-1]), flush=True)
        if processes == 1 and args.locust:
            rows.append(locust_row(ports[0], pids[0], args.connections, args.seconds,
                                   args.out))
        for scenario in args.scenarios.split(",") if processes == 1 and args.profile else ():
            profiles[scenario] = profile(ports[0], pids[0], scenario, args.connections,
                                         args.seconds, args.out)
    finally:
        for server in servers:
            stop_server(server)


def client_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(text.split(","))
    if not kinds or set(kinds) - {"honor", "ignore"}:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of honor, ignore")
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--connections", type=positive, default=64)
    parser.add_argument("--seconds", type=positive, default=20, help="per scenario")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--processes", type=positive_list, default=(1, 2),
                        help="comma list: server processes side by side, one run each")
    parser.add_argument("--clients", type=client_kinds, default=("honor", "ignore"),
                        help="comma list: clients that honor a 429's Retry-After, or ignore it "
                             "(one process only; the first kind alone past one)")
    parser.add_argument("--profile", action="store_true", help="py-spy the one-process runs")
    parser.add_argument("--no-locust", dest="locust", action="store_false",
                        help="skip the Locust row")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/wrk"))
    args = parser.parse_args()
    check_bundle(parser, args.bundle)
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; use {', '.join(SCENARIOS)}")
    if shutil.which("wrk") is None:
        parser.error("wrk is not installed (`make system-deps`)")
    if args.profile and PY_SPY is None:
        parser.error("py-spy is not installed beside this Python (`make install`)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    profiles: dict[str, dict[str, float]] = {}
    for processes in args.processes:
        measure(args, processes, rows, profiles)
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    cpu = f"{cpu}, {psutil.cpu_count()} cores"
    bundle = bundle_note(args.bundle)
    publish(args.out, "wrk", {"cpu": cpu, "bundle": bundle, "rows": rows,
                              "profiles": profiles}, markdown(rows, cpu, bundle, profiles))


if __name__ == "__main__":
    sys.exit(main())
