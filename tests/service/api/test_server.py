"""`r4t serve` wiring and the JSON log lines."""

from __future__ import annotations

import argparse
import json
import logging
import logging.config
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from service.api.middleware import request_id_var
from service.api.server import JsonFormatter, log_config, register, settings_from
from service.errors import InputError
from service.settings import Settings
from tests.service.completion import holding_completions
from tests.service.live import WAIT_S, server_process, wait_until


def test_serve_subcommand_is_registered_with_its_flags():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bundle", type=Path, default=Path("models/default"))
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["--bundle", "models/x", "serve", "--port", "9001",
                              "--routes", "ar=1"])
    assert args.command == "serve" and args.port == 9001 and args.routes == "ar=1"
    assert callable(args.func)


def test_log_lines_are_json_with_the_request_id():
    record = logging.LogRecord("r4t.test", logging.INFO, __file__, 1, "hello %s", ("you",), None)
    record.http = {"status": 200}
    token = request_id_var.set("req-1")
    try:
        line = json.loads(JsonFormatter().format(record))
    finally:
        request_id_var.reset(token)
    assert line["message"] == "hello you" and line["request_id"] == "req-1"
    assert line["http"] == {"status": 200} and line["level"] == "info"


def test_log_config_is_accepted_by_dictconfig():
    logging.config.dictConfig(log_config("warning"))
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("R4T_ROUTES", "diffusion=3,ar=1")
    monkeypatch.setenv("R4T_MAX_BATCH_SIZE", "8")
    settings = Settings()
    assert settings.route_weights() == {"diffusion": 3.0, "ar": 1.0}
    assert settings.max_batch_size == 8 and settings.provider_list is None
    assert "admin_token" not in settings.public()


def refuses_connections(url: str) -> bool:
    try:
        httpx.get(f"{url}/healthz", timeout=WAIT_S)
    except httpx.ConnectError:
        return True
    return False


def test_sigterm_drains_then_finishes_in_flight_work_and_exits_0(
    serving_bundle, completion_server, tmp_path
):
    env = {"R4T_DRAIN_S": str(WAIT_S), "R4T_SHUTDOWN_GRACE_S": str(WAIT_S),
           "R4T_REQUEST_TIMEOUT_MS": str(1000 * WAIT_S)}
    with server_process(serving_bundle, completion_server, tmp_path / "r4t.log", **env) as (
            url, process), ThreadPoolExecutor(1) as pool, \
            holding_completions(completion_server) as held:
        in_flight = pool.submit(httpx.post, f"{url}/v1/retrieve", timeout=WAIT_S,
                                json={"query": "harp", "route": "ar"})
        wait_until(lambda: held.held == 1, "harp's fan-out held in compute")
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{url}/readyz").status_code == 503, "/readyz turned 503")
        assert httpx.get(f"{url}/readyz").json()["status"] == "draining"
        # draining: a load balancer stops sending, but what still arrives is answered
        served = httpx.post(f"{url}/v1/retrieve", json={"query": "oak", "route": "single"})
        assert served.status_code == 200
        process.send_signal(signal.SIGTERM)  # a second one ends the drain: the listener closes
        wait_until(lambda: refuses_connections(url), "the listener closed")
        assert process.poll() is None  # still waiting on the request in flight
        held.release()
        answer = in_flight.result(timeout=WAIT_S)
        assert answer.status_code == 200 and answer.json()["route"] == "ar"
        assert process.wait(timeout=WAIT_S) == 0


def test_a_batch_window_longer_than_the_admission_budget_is_refused_at_start():
    with pytest.raises(ValueError, match="max_wait_ms must be below"):
        Settings(max_wait_ms=600, request_timeout_ms=5000, admit_wait_fraction=0.1)


def test_bad_settings_are_one_clear_error_naming_each_variable():
    with pytest.raises(InputError) as refused:
        settings_from({"admit_wait_fraction": 5, "compute_nice": -3})
    message = str(refused.value)
    assert "R4T_ADMIT_WAIT_FRACTION" in message and "R4T_COMPUTE_NICE" in message
    assert settings_from({"port": 9001}).port == 9001


LOAD_NEVER_ENDS = """
import asyncio, threading
from service.api.state import in_daemon_thread

started = threading.Event()

def load() -> None:
    started.set()
    threading.Event().wait()  # a bundle load that never finishes

async def main() -> None:
    loading = asyncio.ensure_future(in_daemon_thread(0, load))
    await asyncio.get_running_loop().run_in_executor(None, started.wait)
    loading.cancel()  # what shutdown does to a load in flight
    await asyncio.gather(loading, return_exceptions=True)
    print("shut down")

asyncio.run(main())
"""


def test_a_load_in_flight_does_not_hold_the_process_at_exit():
    """A SIGTERM'd server whose reload is still loading exits at once: the load's thread is
    abandoned, not joined at exit as an executor's worker is."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LOAD_NEVER_ENDS], capture_output=True,
                          text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "shut down"


def test_work_still_open_when_the_grace_ends_gets_a_503_not_a_dropped_connection(
    serving_bundle, completion_server, tmp_path
):
    """The routes close as the shutdown grace starts, within all but a margin of it: a request
    whose fan-out outlasts the grace is answered 503 (UnavailableError), then the process
    exits 0."""
    env = {"R4T_DRAIN_S": "0", "R4T_SHUTDOWN_GRACE_S": "2",
           "R4T_REQUEST_TIMEOUT_MS": str(1000 * WAIT_S)}
    with server_process(serving_bundle, completion_server, tmp_path / "r4t.log", **env) as (
            url, process), ThreadPoolExecutor(1) as pool, \
            holding_completions(completion_server) as held:
        in_flight = pool.submit(httpx.post, f"{url}/v1/retrieve", timeout=WAIT_S,
                                json={"query": "harp", "route": "ar"})
        wait_until(lambda: held.held == 1, "harp's fan-out held in compute")
        process.send_signal(signal.SIGTERM)
        answer = in_flight.result(timeout=WAIT_S)
        held.release()
        assert answer.status_code == 503 and "closed" in answer.text
        assert process.wait(timeout=WAIT_S) == 0


def test_an_admin_port_equal_to_the_public_one_is_refused_at_start():
    with pytest.raises(InputError, match="admin_port must differ from port"):
        settings_from({"port": 9001, "admin_port": 9001})
