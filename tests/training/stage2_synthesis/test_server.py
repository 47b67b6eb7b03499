"""`served`: stage 2's model server is up for the block and gone after it, and a server that
dies or never answers is a clear error, not a hang. A real HTTP server process stands in for
vLLM (which needs a GPU): Python's own, serving a folder whose `health` file answers 200."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from service.errors import UnavailableError
from service.loopback import free_port
from training.stage2_synthesis.server import served, vllm_command


def file_server(root: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
            "--directory", str(root)]


def test_the_server_answers_inside_the_block_and_is_stopped_after(tmp_path: Path) -> None:
    (tmp_path / "health").write_text("ok")
    port = free_port()
    with served(file_server(tmp_path, port), f"http://127.0.0.1:{port}",
                tmp_path / "server.log", ready_s=60) as url:
        assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2.0)


def test_a_server_that_exits_is_an_error_with_its_log(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import sys; print('no GPU here'); sys.exit(3)"]
    with pytest.raises(UnavailableError, match=r"exited \(3\)[\s\S]*no GPU here"), \
            served(command, f"http://127.0.0.1:{free_port()}", tmp_path / "server.log"):
        pass


def test_a_server_that_never_gets_ready_times_out(tmp_path: Path) -> None:
    port = free_port()  # serves, but has no /health: 404 until the deadline
    with pytest.raises(UnavailableError, match="not ready after"), \
            served(file_server(tmp_path, port), f"http://127.0.0.1:{port}",
                   tmp_path / "server.log", ready_s=1.5):
        pass


def test_the_vllm_command_serves_the_checkpoint_under_the_asked_name() -> None:
    command = vllm_command(Path("/ckpt"), 8123, "folm", 7)
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(command[3::2], command[4::2], strict=True))
    assert flags["--model"] == "/ckpt" and flags["--served-model-name"] == "folm"
    assert flags["--port"] == "8123" and flags["--seed"] == "7"


def test_a_server_dies_with_the_process_that_holds_it(tmp_path: Path) -> None:
    """A build killed outright (no `finally`) takes its server along: no orphan holds a GPU."""
    (tmp_path / "health").write_text("ok")
    port = free_port()
    holder = textwrap.dedent(f"""
        import os, signal, sys
        from pathlib import Path
        from training.stage2_synthesis.server import served
        command = {file_server(tmp_path, port)!r}
        with served(command, "http://127.0.0.1:{port}", Path({str(tmp_path / 'log')!r})):
            print("ready", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    held = subprocess.run([sys.executable, "-c", holder], cwd=Path(__file__).parents[3],
                          check=False, timeout=60, capture_output=True, text=True)
    assert "ready" in held.stdout, held.stderr  # the server answered before the kill
    assert held.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
        except httpx.TransportError:
            return
        time.sleep(0.1)
    pytest.fail("the server outlived the process that held it")
