"""`r4t serve --build` (what `make serve` runs) from nothing to its first diffusion answer on a
user's small catalog: every route lands, and the log holds no error or warning line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from service.loopback import free_port
from tests.training.stage1_fanout.test_policy import write_tiny_sources

BUILD_WAIT_S = 600.0  # bound on the tiny build (about 30 s alone); reached only when broken


def serves_diffusion(url: str) -> bool:
    try:
        return "diffusion" in httpx.get(f"{url}/readyz", timeout=5.0).json().get("routes", [])
    except httpx.HTTPError:
        return False


def test_serve_build_reaches_a_diffusion_answer_with_a_clean_log(tmp_path: Path) -> None:
    catalog, benchmark = write_tiny_sources(tmp_path)
    port, log = free_port(), tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("R4T_")}  # shipped settings
    command = [sys.executable, "-m", "service.command", "--bundle", str(tmp_path / "bundle"),
               "serve", "--build", "--port", str(port), f"--source={catalog}",
               f"--benchmark={benchmark}", "--preset=tiny"]
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as handle:
        process = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT)
        try:
            stop = time.monotonic() + BUILD_WAIT_S
            while not serves_diffusion(url):
                assert process.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < stop, log.read_text()[-3000:]
                time.sleep(0.5)
            answer = httpx.post(f"{url}/v1/retrieve", timeout=60.0,
                                json={"query": "camping", "route": "diffusion"})
        finally:
            process.terminate()
            process.wait(timeout=60)
    assert answer.status_code == 200 and answer.json()["route"] == "diffusion"
    lines = log.read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith('{"time"')]
    assert any("no bundle yet" in r["message"] for r in records)  # said as info
    loud = [r for r in records if r["level"] in ("warning", "error", "critical")]
    assert not loud, loud
    assert not [line for line in lines if "Warning:" in line or "Traceback" in line]
