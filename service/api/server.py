"""`r4t serve`: uvicorn running `create_app(settings)`, logging one JSON object per line.

Every line carries its request's id (service.api.middleware); settings come from `R4T_*`, the
flags over them. `--build` runs `r4t bundle` in a child process and serves each stage as it
lands, so a fresh machine answers within minutes instead of after the whole offline job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import logging.config
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from pydantic import ValidationError

from service.api.middleware import current_request_id
from service.api.protocol import receive_deadline_protocol
from service.artifacts.bundle import require_stages
from service.errors import InputError
from service.settings import DEFAULT_BUNDLE, Settings

if TYPE_CHECKING:
    from fastapi import FastAPI

WATCH_S = 2.0  # manifest poll period while a background build runs
BUILD_NICENESS = 10  # the build yields the cores to requests
CLOSE_MARGIN_S = 1.0  # of the shutdown grace, left to send the 503s of work still open
BUILD_FLAGS = ("source", "benchmark", "preset")  # passed on to the build: a user's own catalog
STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {
    "message", "asctime", "taskName", "color_message",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, request_id, extras."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": current_request_id(),
        }
        for key, value in vars(record).items():
            if key not in STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def log_config(level: str) -> dict[str, Any]:
    """dictConfig for uvicorn and r4t: JSON to stderr; uvicorn's access log replaced by ours."""
    level = level.upper()
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"json": handler},
        "root": {"handlers": ["json"], "level": "WARNING"},
        "loggers": {
            "httpx": {"level": "WARNING"},
            "bm25s": {"level": "WARNING"},  # it logs each index build at DEBUG
            "r4t": {"handlers": ["json"], "level": level, "propagate": False},
            "uvicorn": {"handlers": ["json"], "level": level, "propagate": False},
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM first drains: /readyz turns 503 while requests are still served for
    `drain_s` (a load balancer stops sending), then the listener closes, in-flight requests
    finish within `shutdown_grace_s`, and the process exits 0 (uvicorn would re-raise the
    signal after its shutdown, which kills the process with status -15). A second SIGTERM
    ends the drain early."""

    def __init__(self, config: uvicorn.Config, begin_drain: Callable[[], None],
                 drain_s: float, close_routes: Callable[[float], Awaitable[None]]) -> None:
        super().__init__(config)
        self.begin_drain, self.drain_s, self.close_routes = begin_drain, drain_s, close_routes
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Close the routes as uvicorn's grace starts, within all but CLOSE_MARGIN_S of it:
        a request still queued or computing then gets a 503, not a dropped connection."""
        grace = float(self.config.timeout_graceful_shutdown or 0)
        closing = asyncio.ensure_future(self.close_routes(max(grace - CLOSE_MARGIN_S, 0.0)))
        try:
            await super().shutdown(sockets)
        finally:
            await closing

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.loop is None:
            super().handle_exit(sig, frame)
        else:  # on the loop, not in the handler: the handler may interrupt a held lock
            self.loop.call_soon_threadsafe(self.on_sigterm)

    def on_sigterm(self) -> None:
        if self.draining:  # a second SIGTERM ends the drain now
            self.stop()
            return
        self.draining = True
        self.begin_drain()
        assert self.loop is not None
        self.loop.call_later(self.drain_s, self.stop)

    def stop(self) -> None:
        self.should_exit = True


def server_for(settings: Settings, app: FastAPI, log_config: dict[str, Any] | None = None
               ) -> DrainingServer:
    """The uvicorn server `r4t serve` runs: the service's limits, drain and receive deadline."""
    from service.api.app import gated  # the web stack loads only when serving

    state = app.state.r4t
    protocol = receive_deadline_protocol(
        settings.receive_timeout_s, state.metrics.rejected.labels(reason="ReceiveTimeout").inc
    )
    config = uvicorn.Config(
        gated(app), host=settings.host, port=settings.port, log_config=log_config, http=protocol,
        access_log=False, proxy_headers=False, server_header=False, timeout_keep_alive=30,
        limit_concurrency=settings.max_connections,
        timeout_graceful_shutdown=settings.shutdown_grace_s,  # type: ignore[arg-type]
    )
    return DrainingServer(config, state.begin_drain, settings.drain_s, state.close_routes)


def listening(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), IPv6 when the host is an IPv6 address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve(settings: Settings | None = None) -> None:
    """Run the service in the foreground until interrupted: on R4T_PORT, and with
    R4T_ADMIN_PORT also on that port (the only one that serves /admin/*)."""
    from service.api.app import create_app

    settings = settings or Settings()
    config = log_config(settings.log_level)
    logging.config.dictConfig(config)
    ports = [settings.port] if settings.admin_port is None else [settings.port,
                                                                  settings.admin_port]
    sockets = [listening(settings.host, port) for port in ports]
    server_for(settings, create_app(settings), config).run(sockets=sockets)


@contextmanager
def background_build(bundle: Path, flags: Sequence[str] = ()) -> Iterator[subprocess.Popen]:
    """`r4t bundle` (with `flags`) in a lower-priority child process (its progress bars on this
    terminal); stopped when serving ends."""
    command = [sys.executable, "-m", "service.command", "--bundle", str(bundle), "bundle",
               *flags]
    child = subprocess.Popen(command, preexec_fn=lambda: os.nice(BUILD_NICENESS))
    try:
        yield child
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()


def cmd_serve(args: argparse.Namespace) -> None:
    """Flags override R4T_* variables; R4T_BUNDLE wins over an unchanged default --bundle."""
    overrides: dict[str, Any] = {}
    if not (os.environ.get("R4T_BUNDLE") and Path(args.bundle) == DEFAULT_BUNDLE):
        overrides["bundle"] = args.bundle
    for name in ("host", "port", "routes", "openai_base_url", "providers", "log_level"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    settings = settings_from(overrides)
    flags = [f"--{name}={value}" for name in BUILD_FLAGS
             if (value := getattr(args, name, None)) is not None]
    if flags and not getattr(args, "build", False):
        raise InputError(f"{' '.join(flags)}: these build flags need --build")
    if not getattr(args, "build", False):
        if not settings.watch_s:  # nothing would ever arrive: say what builds it, exit 2
            require_stages(settings.bundle, ("catalog",), "r4t serve (or `r4t serve --build`)")
        serve(settings)
        return
    if not settings.watch_s:
        settings = settings.model_copy(update={"watch_s": WATCH_S})
    with background_build(settings.bundle, flags):
        serve(settings)


def settings_from(overrides: dict[str, Any]) -> Settings:
    """The settings, or an InputError naming each bad R4T_* variable (r4t prints it)."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"R4T_{'_'.join(str(p) for p in error['loc']).upper() or '*'}: {error['msg']}"
            f" (got {error.get('input')!r})" if error["loc"] else error["msg"]
            for error in exc.errors()
        )
        raise InputError(f"invalid settings: {problems}") from None


def register(sub: argparse._SubParsersAction) -> None:
    """Add `r4t serve` to the r4t command (the bundle comes from the global --bundle)."""
    parser = sub.add_parser(
        "serve", help="serve the bundle over HTTP (settings: R4T_* environment variables)"
    )
    parser.add_argument("--host", default=None, help="bind address (R4T_HOST)")
    parser.add_argument("--port", type=int, default=None, help="port (R4T_PORT)")
    parser.add_argument("--routes", default=None, help="A/B weights, e.g. diffusion=0.9,ar=0.1")
    parser.add_argument("--openai-base-url", default=None,
                        help="OpenAI-compatible endpoint for the ar route")
    parser.add_argument("--providers", default=None, help="ONNX Runtime providers or 'auto'")
    parser.add_argument("--log-level", default=None, help="log level (R4T_LOG_LEVEL)")
    parser.add_argument("--build", action="store_true",
                        help="also build what the bundle lacks (`r4t bundle`, in the "
                             "background) and serve each route as its stage lands")
    for name in BUILD_FLAGS:  # checked by `r4t bundle` itself, which owns them
        parser.add_argument(f"--{name}", default=None,
                            help=f"with --build: `r4t bundle --{name}` (see r4t bundle --help)")
    parser.set_defaults(func=cmd_serve)
