"""A server started on loopback and waited for: a free port, and readiness by polling.

One definition for whoever starts one (`r4t serve` under the load tests and the tests, the
stage-2 model server): nothing here is used by the service itself.
"""

from __future__ import annotations

import socket
import subprocess
import time

import httpx

from service.errors import UnavailableError

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on now (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, timeout_s: float = 180.0, process: subprocess.Popen | None = None,
               poll_s: float = 0.1) -> None:
    """Until GET `url` (a readiness probe: /readyz, /health) answers 200. UnavailableError at
    once if `process` (the server's) exits first, and when `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise UnavailableError(f"the server for {url} exited ({process.returncode}) "
                                       "before it was ready")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
    raise UnavailableError(f"the server for {url} was not ready after {timeout_s:.0f} s")
