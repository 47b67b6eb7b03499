"""A real Prometheus on loopback scrapes a live `r4t serve`; the metrics must arrive."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from service.loopback import free_port
from tests.prerequisites import needs
from tests.service.live import serve_process

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = needs("prometheus", "promtool", package="Debian's prometheus package "
                         "(make system-deps, .ci/run)")


@needs_prometheus
def test_alert_rules_are_valid_and_their_unit_tests_pass():
    rules = DEPLOY / "prometheus"
    check = subprocess.run([PROMTOOL, "check", "rules", str(rules / "alerts.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([PROMTOOL, "test", "rules", str(rules / "alerts_test.yml")],
                          capture_output=True, text=True)
    assert unit.returncode == 0, unit.stdout + unit.stderr


@pytest.fixture
def live_r4t(serving_bundle, completion_server, tmp_path):
    """`r4t serve` as a subprocess; the quality gate is set so every diffusion answer falls back."""
    with serve_process(serving_bundle, completion_server, tmp_path / "r4t.log",
                       R4T_GROUNDEDNESS_THRESHOLD="0.999") as live:
        yield live


@pytest.fixture
def live_prometheus(live_r4t, tmp_path):
    _, target_port = live_r4t
    rules = tmp_path / "alerts.yml"
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", rules)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{rules}]\n"
        "scrape_configs:\n  - job_name: r4t\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n"
    )
    port = free_port()
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)


def query(prometheus: str, expr: str, timeout_s: float = 60.0) -> list[dict]:
    """Poll Prometheus's HTTP API until `expr` returns a non-empty vector."""
    stop = time.monotonic() + timeout_s
    while time.monotonic() < stop:
        try:
            reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=5)
            result = reply.json()["data"]["result"]
            if result:
                return result
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"Prometheus returned nothing for {expr!r} within {timeout_s} s")


@needs_prometheus
def test_prometheus_scrapes_stage_histograms_and_fallbacks(live_r4t, live_prometheus):
    url, _ = live_r4t
    with httpx.Client(base_url=url, timeout=30) as client:
        for route in ("diffusion", "ar", "diffusion"):
            reply = client.post("/v1/retrieve", json={"query": "dog", "k": 10, "route": route})
            assert reply.status_code == 200, reply.text
        assert reply.json()["fallback"]["used"] is True

    stages = query(live_prometheus, 'r4t_stage_duration_seconds_count{route="diffusion"} > 0')
    assert {"solver", "search"} <= {s["metric"]["stage"] for s in stages}
    ar_stages = query(live_prometheus, 'r4t_stage_duration_seconds_count{route="ar"} > 0')
    assert "search" in {s["metric"]["stage"] for s in ar_stages}
    fallbacks = query(live_prometheus, "r4t_fallbacks_total > 0")
    assert sum(float(f["value"][1]) for f in fallbacks) >= 2
    assert query(live_prometheus, "r4t_ready == 1")
    assert query(live_prometheus, 'up{job="r4t"} == 1')
