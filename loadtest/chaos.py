"""`make chaos`: faults under load, each a bounded scenario against its own `r4t serve`, with
its figures in one JSON report (chaos.json, chaos.md). Exits 1 when a case fails.

- reload: a new bundle swapped in under load (zero failed requests, the swap visible in
  /v1/info and r4t_bundle_info, /healthz answered within HEALTHZ_P99_MS at p99 throughout); a
  corrupted and a partial copy refused under load;
- sigterm: /readyz turns 503 first, requests in flight finish, the listener closes, exit 0;
- diffusion_faults: the sampler fails a share of batches (R4T_FAULT_DIFFUSION_RATE); those
  requests are answered by AR with the reason set, and the fallback alert fires in
  `promtool test rules` at the rates measured;
- ar_backend: the OpenAI-compatible endpoint of the AR path down, then slower than the request
  deadline, then back, with the shipped timeouts and retries: a clear 503 (down) or 504 (slow)
  by the deadline, never later, then recovery;
- clients: clients that leave mid-request and clients that trickle their headers: no worker
  stuck, no descriptor or queue slot leaked;
- hostile: batch calls of hostile inputs (1,000 characters, frequent and never-seen words,
  FTS5 syntax, emoji filters, HTML) in a loop: every answer a 200 or a 4xx, /healthz within
  HEALTHZ_P99_MS at p99.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from loadtest.chaos_harness import (
    HEALTHZ_P99_MS,
    RATE,
    ROUND_TRIP_MS,
    STEADY_S,
    Case,
    Chaos,
    Completions,
    Liveness,
    completions,
    first_time,
    metric,
    not_ready,
    refuses,
    reload,
    served_version,
    statuses,
)
from loadtest.hostile import HOSTILE, hostile_batch
from loadtest.openloop import TRANSPORT_ERROR, Load, scenario_body, summarize
from loadtest.report import publish
from loadtest.run import HOST, check_bundle
from service.loopback import free_port
from service.settings import DEFAULT_BUNDLE, Settings

ALERTS = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "alerts.yml"


def case_reload(chaos: Chaos) -> dict[str, Any]:
    corrupt = chaos.copy("corrupt", real=("diffusion/sampler.onnx",))
    with (corrupt / "diffusion" / "sampler.onnx").open("r+b") as handle:
        handle.seek(1000)
        byte = handle.read(1)
        handle.seek(1000)
        handle.write(bytes([byte[0] ^ 0xFF]))
    partial = chaos.copy("partial")
    (partial / "index.faiss").unlink()
    fresh = chaos.copy("next")
    with chaos.server("reload") as (url, _):
        before = served_version(url)
        load = Load(url, RATE, 3600.0, scenario_body("mix"), seed=21).start()
        time.sleep(3.0)  # load reaches steady state
        with Liveness(url) as liveness:
            refused = {name: reload(url, path) for name, path in
                       (("corrupt", corrupt), ("partial", partial))}
            kept = served_version(url)
            swapped = reload(url, fresh)
            after = served_version(url)
            info_metric = metric(url, "r4t_bundle_info", version=after)
            time.sleep(6.0)  # and goes on, served by the new bundle; the old one retires
        load.stop()
        shots = load.join()
    counts = statuses(shots)
    result = {
        "healthz_during_reloads": liveness.summary(),
        "requests_by_status": counts, "version_before": before, "version_after": after,
        "refused": {n: {"status": r.status_code, "error": r.json().get("error", {}).get(
            "message", "")[:160]} for n, r in refused.items()},
        "kept_serving_after_refusals": kept == before, "swap_status": swapped.status_code,
        "bundle_info_metric": info_metric,
    }
    result["passed"] = (set(counts) == {"200"} and kept == before
                        and liveness.summary()["p99_ms"] <= HEALTHZ_P99_MS
                        and liveness.summary()["failures"] == 0
                        and all(r.status_code == 422 for r in refused.values())
                        and swapped.status_code == 200 and after != before
                        and info_metric == 1.0)
    return result


def case_sigterm(chaos: Chaos) -> dict[str, Any]:
    drain_s, grace_s = 3.0, 10.0
    env = {"R4T_DRAIN_S": str(drain_s), "R4T_SHUTDOWN_GRACE_S": str(grace_s)}
    with chaos.server("sigterm", **env) as (url, process):
        load = Load(url, RATE, 3600.0, scenario_body("mix"), seed=22).start()
        time.sleep(STEADY_S + 2.0)  # load reaches steady state
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        until = sent + drain_s + grace_s + 30
        readyz_503_s = first_time(lambda: not_ready(url), sent, until)
        closed_s = first_time(lambda: refuses(url), sent, until)
        try:
            code = process.wait(timeout=max(until - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            code = None
        exited_s = time.monotonic() - sent
        load.stop()
        shots = load.join()
    signal_at = sent - load.started
    closed_at = signal_at + (closed_s if closed_s is not None else exited_s)
    # judged from the signal on: the load's first second meets a cold server (its caches
    # empty), where admission may refuse a few, which is not what this case is about
    warming = [s for s in shots if s.due < signal_at - STEADY_S]
    before_close = [s for s in shots if signal_at - STEADY_S <= s.due < closed_at - 0.1]
    after_close = [s for s in shots if s.due > closed_at]
    result = {
        "drain_s": drain_s, "grace_s": grace_s, "readyz_503_after_s": readyz_503_s,
        "listener_closed_after_s": closed_s, "exit_code": code, "exited_after_s": exited_s,
        "due_while_warming": statuses(warming),
        "due_before_close": statuses(before_close), "due_after_close": statuses(after_close),
    }
    result["passed"] = (code == 0 and readyz_503_s is not None and closed_s is not None
                        and readyz_503_s < closed_s and exited_s <= drain_s + grace_s + 5
                        and set(statuses(before_close)) == {"200"}
                        and set(statuses(after_close)) <= {str(TRANSPORT_ERROR)})
    return result


def promtool_alert(fallbacks_per_min: float, diffusion_per_min: float, folder: Path
                   ) -> dict[str, Any]:
    """Run the fallback alert rule on series growing at the measured per-minute rates."""
    test = folder / "fallback_alert_test.yml"
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    rule = next(r for r in rules if r.get("alert") == "R4THighFallbackRate")
    test.write_text(json.dumps({
        "rule_files": [str(ALERTS)], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": [
            {"series": 'r4t_fallbacks_total{reason="error"}',
             "values": f"0+{fallbacks_per_min:.1f}x30"},
            {"series": 'r4t_request_duration_seconds_count{route="diffusion",arm="diffusion",'
                       'status="200"}', "values": f"0+{diffusion_per_min:.1f}x30"}],
            "alert_rule_test": [{"eval_time": "25m", "alertname": "R4THighFallbackRate",
                                 "exp_alerts": [{"exp_labels": rule["labels"],
                                                 "exp_annotations": rule["annotations"]}]}]}],
    }, indent=2))  # JSON is YAML
    promtool = shutil.which("promtool")
    if promtool is None:
        return {"ran": False, "passed": False, "output": "promtool not installed"}
    done = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True)
    return {"ran": True, "passed": done.returncode == 0,
            "output": (done.stdout + done.stderr).strip()[-400:]}


def case_diffusion_faults(chaos: Chaos) -> dict[str, Any]:
    rate, seconds = 0.3, 20.0
    env = {"R4T_FAULT_DIFFUSION_RATE": str(rate), "R4T_ROUTES": "diffusion=1"}
    with chaos.server("faults", **env) as (url, _):
        before_f = metric(url, "r4t_fallbacks_total", reason="error")
        before_d = metric(url, "r4t_request_duration_seconds_count", route="diffusion")
        shots = Load(url, RATE, seconds, scenario_body("mix"), seed=23).run()
        fallbacks = metric(url, "r4t_fallbacks_total", reason="error") - before_f
        diffusion = metric(url, "r4t_request_duration_seconds_count", route="diffusion") - before_d
    by_route: dict[str, int] = {}
    for shot in shots:
        by_route[str(shot.route)] = by_route.get(str(shot.route), 0) + 1
    share = fallbacks / max(fallbacks + diffusion, 1.0)
    alert = promtool_alert(60 * fallbacks / seconds, 60 * diffusion / seconds, chaos.out)
    result = {"fault_rate": rate, "requests_by_status": statuses(shots),
              "answered_by_route": by_route, "fallbacks_error": fallbacks,
              "fallback_share": round(share, 3), "alert": alert}
    result["passed"] = (set(statuses(shots)) == {"200"} and by_route.get("ar", 0) == fallbacks
                        and abs(share - rate) < 0.15 and alert["passed"])
    return result


def ar_phase(url: str, seconds: float, seed: int) -> dict[str, Any]:
    """10 req/s forced onto AR, each query new to the expansion cache (numbered), so that every
    one reaches the endpoint."""
    queries = scenario_body("ar")
    numbered = itertools.count()

    def body(rng: random.Random) -> dict[str, Any]:
        request = queries(rng)
        return {**request, "query": f"{request['query']} {seed}-{next(numbered)}"}

    shots = Load(url, 10.0, seconds, body, seed=seed, timeout_s=30.0).run()
    summary = summarize(shots, seconds, 10.0)
    return {k: summary[k] for k in ("counts_by_status", "latency_ms_by_status")}


def case_ar_backend(chaos: Chaos) -> dict[str, Any]:
    """The shipped timeouts and retries (no R4T_OPENAI_* override): every answer, refusal or
    error comes by the request deadline (plus the HTTP round trip), whatever the endpoint does."""
    port, settings = free_port(), Settings()
    env = {"R4T_AR_BACKEND": "openai", "R4T_OPENAI_BASE_URL": f"http://{HOST}:{port}/v1",
           "R4T_ROUTES": "ar=1"}
    bound_ms = settings.request_timeout_ms + ROUND_TRIP_MS
    phases: dict[str, Any] = {}
    with completions(port) as endpoint, chaos.server("ar", **env) as (url, _):
        phases["up"] = ar_phase(url, 10.0, 31)
        endpoint.shutdown()
        endpoint.server_close()
        phases["down"] = ar_phase(url, 10.0, 32)
        with completions(port):
            Completions.delay_s = 2 * settings.request_timeout_ms / 1000  # past every deadline
            phases["slow"] = ar_phase(url, 10.0, 33)
            Completions.delay_s = 0.0
            phases["back"] = ar_phase(url, 10.0, 34)
        error = httpx.post(f"{url}/v1/retrieve", json={"query": "boat gone", "route": "ar"},
                           timeout=30.0)
    failing = [phases["down"], phases["slow"]]
    result = {"timeout_s": settings.openai_timeout_s, "retries": settings.openai_retries,
              "latency_bound_ms": bound_ms, "phases": phases,
              "status_after_endpoint_gone": error.status_code}
    result["passed"] = (
        set(phases["up"]["counts_by_status"]) == {"200"}
        and set(phases["back"]["counts_by_status"]) == {"200"}
        and all(set(p["counts_by_status"]) <= {"503", "504", "429"} for p in failing)
        and error.status_code == 503
        and all(lat["99"] <= bound_ms for p in failing
                for status, lat in p["latency_ms_by_status"].items() if status != "429"))
    return result


def leave_mid_request(url: str, n: int) -> None:
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps({"query": "gone", "route": "diffusion"}).encode()
    request = (b"POST /v1/retrieve HTTP/1.1\r\nhost: r4t\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
    for _ in range(n):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(request)  # and close at once


def case_clients(chaos: Chaos) -> dict[str, Any]:
    receive_timeout_s, slow, gone = 2.0, 20, 100
    with chaos.server("clients", R4T_RECEIVE_TIMEOUT_S=str(receive_timeout_s)) as (url, proc):
        server = psutil.Process(proc.pid)
        time.sleep(1.0)
        baseline = server.num_fds()
        load = Load(url, RATE, 3600.0, scenario_body("mix"), seed=41).start()
        host, port = url.removeprefix("http://").split(":")
        trickling = [socket.create_connection((host, int(port))) for _ in range(slow)]
        for sock in trickling:
            sock.sendall(b"POST /v1/retrieve HTTP/1.1\r\nhost: r4t\r\ncontent-")
        leave_mid_request(url, gone)
        started = time.monotonic()
        closed = []
        try:
            for sock in trickling:  # the server answers 408 and closes each
                sock.settimeout(receive_timeout_s * 5)
                answer = b""
                with contextlib.suppress(TimeoutError):
                    while chunk := sock.recv(4096):
                        answer += chunk
                closed.append((time.monotonic() - started,
                               answer.split(b"\r\n", 1)[0].decode() or "no answer"))
        finally:
            for sock in trickling:
                sock.close()
            load.stop()
        shots = load.join()
        time.sleep(1.0)
        result = {
            "slow_clients": slow, "slow_closed_after_s": round(max(t for t, _ in closed), 2),
            "slow_answers": sorted({a for _, a in closed}),
            "left_mid_request": gone,
            "client_gone_counted": metric(url, "r4t_rejected_requests_total",
                                          reason="ClientGone"),
            "receive_timeouts_counted": metric(url, "r4t_rejected_requests_total",
                                               reason="ReceiveTimeout"),
            "fds_before": baseline, "fds_after": server.num_fds(),
            "in_flight_after": metric(url, "r4t_in_flight"),
            "queue_depth_after": metric(url, "r4t_queue_depth"),
            "requests_by_status": statuses(shots),
            "answered_after": httpx.post(f"{url}/v1/retrieve", json={"query": "boat"},
                                         timeout=30.0).status_code,
        }
    # the 100 that leave arrive at once, far past capacity: the load beside them may see 429s
    result["passed"] = (set(result["requests_by_status"]) <= {"200", "429"}
                        and result["slow_answers"] == ["HTTP/1.1 408 Request Timeout"]
                        and result["receive_timeouts_counted"] == slow
                        and result["fds_after"] <= result["fds_before"]
                        and result["in_flight_after"] == 0 and result["queue_depth_after"] == 0
                        and result["answered_after"] == 200)
    return result


def case_hostile(chaos: Chaos) -> dict[str, Any]:
    """Batch calls of hostile inputs (loadtest/hostile.py) in a loop, one after another, each
    at the batch limit over every route: every answer a 200 or a 4xx, /healthz within
    HEALTHZ_P99_MS at p99 throughout (their cost stays off the event loop)."""
    seconds, counts = 20.0, {}
    with chaos.server("hostile", R4T_REQUEST_TIMEOUT_MS="30000") as (url, _), \
            Liveness(url) as liveness, httpx.Client(base_url=url, timeout=120.0) as client:
        served = ("auto", *client.get("/readyz").json()["routes"])
        kinds, stop = itertools.cycle(sorted(HOSTILE)), time.monotonic() + seconds
        for seed in itertools.count():
            if time.monotonic() >= stop:
                break
            kind = next(kinds)
            status = str(client.post("/v1/retrieve:batch",
                                     json=hostile_batch(kind, seed, served)).status_code)
            counts.setdefault(kind, {}).setdefault(status, 0)
            counts[kind][status] += 1
    answered = {status for by_status in counts.values() for status in by_status}
    result = {"batch_calls_by_kind_and_status": counts, "healthz": liveness.summary()}
    result["passed"] = (all(s == "200" or s.startswith("4") for s in answered)
                        and liveness.summary()["p99_ms"] <= HEALTHZ_P99_MS
                        and liveness.summary()["failures"] == 0)
    return result


CASES: dict[str, Case] = {"reload": case_reload, "sigterm": case_sigterm,
                          "diffusion_faults": case_diffusion_faults,
                          "ar_backend": case_ar_backend, "clients": case_clients,
                          "hostile": case_hostile}


def rounded(value: Any) -> Any:
    """Floats to 3 decimals, all the way down (the report is read by people)."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value


def markdown(report: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, result in report.items():
        lines += [f"### {name}: {'passed' if result['passed'] else 'FAILED'}", ""]
        for key, value in rounded(result).items():
            if key != "passed":
                text = value if isinstance(value, str | int | float) else json.dumps(value)
                lines.append(f"- {key}: {text}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--port", type=int, default=8770, help="first port; one per case")
    parser.add_argument("--cases", default=",".join(CASES), help="comma list")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/chaos"))
    args = parser.parse_args()
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from {sorted(CASES)}")
    check_bundle(parser, args.bundle)
    args.out.mkdir(parents=True, exist_ok=True)
    chaos = Chaos(args.bundle, args.out, args.port)
    report: dict[str, dict[str, Any]] = {}
    try:
        for name in args.cases.split(","):
            print(f"chaos: {name} ...", flush=True)
            report[name] = CASES[name](chaos)
            print(f"chaos: {name} {'passed' if report[name]['passed'] else 'FAILED'}",
                  flush=True)
    finally:
        chaos.clean()
    chaos.clean()
    publish(args.out, "chaos", report, markdown(report))
    sys.exit(0 if all(r["passed"] for r in report.values()) else 1)


if __name__ == "__main__":
    main()
