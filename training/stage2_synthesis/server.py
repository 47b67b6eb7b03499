"""A model server held for the length of stage 2: vLLM's OpenAI-compatible server on the frozen
policy (`--backend vllm`), which the http backend then samples.

Hand-written because vLLM ships the server but no way to hold one for a with-block: start it in
its own process group, wait until `/health` answers (or the process dies, with its log's tail
in the error), stop the group on the way out, whatever happened. A build killed outright sends
the server SIGTERM (the parent-death signal), which shuts its engine workers down with it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from service.errors import UnavailableError
from service.loopback import wait_ready

READY_S = 900.0  # a 4B checkpoint loads and compiles its CUDA graphs in minutes
POLL_S = 0.5
STOP_S = 30.0
LOG_TAIL = 2000


def vllm_command(checkpoint: Path, port: int, model: str, seed: int) -> list[str]:
    """`vllm serve` on `checkpoint` under the name the http backend asks for."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(checkpoint), "--served-model-name", model, "--host", "127.0.0.1", "--port",
            str(port), "--seed", str(seed), "--generation-config", "vllm"]


@contextmanager
def served(command: list[str], base_url: str, log: Path, ready_s: float = READY_S,
           ) -> Iterator[str]:
    """Run `command` (a server on `base_url`) until the block ends; yields `base_url` once its
    `/health` answers 200."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        process = subprocess.Popen(dying_with_parent(command), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_ready(f"{base_url}/health", ready_s, process, POLL_S)
        except UnavailableError as exc:
            raise UnavailableError(f"the model server: {exc}; {log}:\n{tail(log)}") from exc
        yield base_url
    finally:
        stop(process)


def dying_with_parent(command: list[str]) -> list[str]:
    """`command` under util-linux's `setpriv --pdeathsig TERM` where it exists: SIGTERM when
    the build process dies (a preexec_fn calling prctl is not safe in a threaded parent)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", *command] if setpriv else command


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM forks engine workers, which may outlive
    their parent), SIGKILL to whatever lingers."""
    group = process.pid  # start_new_session: the group is the server's pid
    signal_group(group, signal.SIGTERM)
    try:
        process.wait(STOP_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    signal_group(group, signal.SIGKILL)  # engine workers left behind


def signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, sig)


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-LOG_TAIL:] if log.is_file() else ""
