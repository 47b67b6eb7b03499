"""The served state and its lifecycle: the current retriever (swapped whole on reload), start-
up in the background, the watched reload with its backoff, and the retirement of a replaced
bundle; kept apart from the routes so the loop that serves never reads like the one that loads."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request

from service.api.middleware import ARRIVAL_KEY
from service.api.responses import retrieve_response
from service.api.schemas import ReloadStatus, RetrieveRequest, RetrieveResponse
from service.artifacts.bundle import MANIFEST, now_iso
from service.errors import (
    BundleAbsentError,
    IndexUnavailableError,
    InputError,
    R4TError,
    UnavailableError,
)
from service.metrics import Metrics
from service.routes.answer import RouteQuery
from service.scheduling.assembly import Loaders
from service.scheduling.batching import yield_to_the_loop
from service.scheduling.retriever import Retriever
from service.settings import Settings

log = logging.getLogger("r4t.app")
T = TypeVar("T")
ENGINE_RETRY_S = 2.0  # how often a start-up refused for its index engine being down retries
WATCH_BACKOFF_MAX_S = 60.0  # the longest wait before a failed watched reload is tried again


def settle_heap() -> None:
    """Collect what is not frozen yet (the newly loaded bundle: milliseconds), then freeze it
    out of the cyclic collector's reach: a full collection walks every object of the process,
    hundreds of milliseconds with the event loop stopped, which under load were the service's
    slowest answers. Nothing is unfrozen: a retired bundle holds no reference cycle (tests
    check), so reference counting frees it without a full collection."""
    gc.collect()
    gc.freeze()


class ServiceState:
    """What the routes read: the current retriever (swapped atomically) and reload status."""

    def __init__(self, settings: Settings, loaders: Loaders) -> None:
        self.settings, self.loaders = settings, loaders
        self.metrics = Metrics()
        self.retriever: Retriever | None = None
        self.startup = "loading"
        self.startup_error: str | None = None
        self.reload = ReloadStatus(state="idle")
        self.reload_task: asyncio.Task | None = None
        self.retiring: set[asyncio.Task] = set()
        self.draining = False

    def begin_drain(self) -> None:
        """SIGTERM: report not ready (a load balancer stops sending) but keep serving."""
        self.draining = True
        self.metrics.ready.set(0)
        log.info("draining: /readyz answers 503 until the listener closes")

    def ready(self) -> Retriever:
        if self.retriever is None:
            why = self.startup_error or "the bundle is loading and warming up"
            raise UnavailableError(f"not ready: {why}")
        return self.retriever

    async def load(self, bundle_dir: Path, strict: bool, traffic: Sequence[str] = (),
                   served: Collection[str] = ()) -> Retriever:
        """A started, warm retriever of `bundle_dir`. Strict (a reload): every route the bundle
        it replaces served (`served`) and every arm its own routes stage chose must load and
        warm up; a build in progress only adds routes."""
        retriever = await in_daemon_thread(self.settings.compute_nice, Retriever.load,
                                           self.settings, self.metrics, bundle_dir, self.loaders)
        retriever.start()
        try:
            if strict:
                chosen = retriever.weights if retriever.weights_from == "bundle" else {}
                retriever.require({*served, *(r for r, w in chosen.items() if w)})
            await retriever.warm_up(strict=strict, traffic=traffic)
        except BaseException:
            await retriever.close()
            raise
        return retriever

    def publish(self, retriever: Retriever) -> Retriever | None:
        """Swap the served retriever (one assignment on the event loop: atomic)."""
        old, self.retriever = self.retriever, retriever
        settle_heap()
        providers = sorted({p for ps in retriever.providers.values() for p in ps})
        encoder = retriever.bundle.manifest.get("encoder", {})
        self.metrics.set_bundle(
            retriever.version, f"{encoder.get('name')}/{encoder.get('dim')}", ",".join(providers)
        )
        return old

    async def answer(self, request: Request, queries: list[RetrieveRequest]
                     ) -> list[RetrieveResponse]:
        """Answer queries concurrently (they share batches); one failure cancels the rest."""
        retriever = self.ready()
        for query in queries:
            check_limits(query, self.settings, retriever)
        arrival = request.scope.get(ARRIVAL_KEY, time.monotonic())
        deadline = arrival + self.settings.request_timeout_ms / 1000.0  # counted from arrival
        tasks = [asyncio.ensure_future(self.observed(q, deadline)) for q in queries]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()  # no-op when done; stops the rest when one failed

    async def observed(self, query: RetrieveRequest, deadline: float) -> RetrieveResponse:
        started = time.monotonic()
        retriever = self.ready()
        try:  # read the served retriever and submit in one loop step: a swap cannot split them
            served = await retriever.retrieve(asked(query), deadline)
        except R4TError as exc:
            self.metrics.request_duration.labels(
                route=getattr(exc, "route", query.route), arm=getattr(exc, "arm", "none"),
                status=str(exc.http_status),
            ).observe(time.monotonic() - started)
            raise
        self.metrics.request_duration.labels(
            route=served.route, arm=served.arm, status="200"
        ).observe(time.monotonic() - started)
        return retrieve_response(served, retriever.bundle)

    async def start(self) -> None:
        try:
            self.publish(await self.load(self.settings.bundle, strict=False))
            self.startup = "ready"
            self.metrics.ready.set(0 if self.draining else 1)
            log.info("ready", extra={"info": {"bundle": str(self.settings.bundle)}})
        except Exception as exc:
            self.startup, self.startup_error = "failed", f"{type(exc).__name__}: {exc}"
            if isinstance(exc, BundleAbsentError) and self.settings.watch_s:
                self.startup = "waiting"  # a build (serve --build) or a copy will write it
                log.info("no bundle yet at %s: serving it once it lands", self.settings.bundle)
                return
            log.error("start-up failed: %s", self.startup_error)

    async def watch(self) -> None:
        """Reload the served bundle when its manifest changes (a stage landed; with watch_s);
        a bundle that was absent or refused at start-up is loaded once it can be, and one
        refused because its index engine was down, once the engine answers. A watched reload
        that fails is retried, at a delay doubling up to WATCH_BACKOFF_MAX_S."""
        seen, failures = self.manifest_stamp(), 0
        while True:
            await asyncio.sleep(backoff(self.settings.watch_s or ENGINE_RETRY_S, failures))
            stamp = self.manifest_stamp()
            busy = self.startup == "loading" or (self.reload_task is not None
                                                 and not self.reload_task.done())
            engine_down = self.retriever is None and (self.startup_error or "").startswith(
                IndexUnavailableError.__name__)  # retried until the engine answers
            changed = self.settings.watch_s > 0 and stamp not in (seen, None)
            if busy or not (engine_down or changed or failures):
                continue
            why = ("a stage landed" if changed else "its index engine was down" if engine_down
                   else "its last reload failed")
            log.info("reloading the bundle: %s", why,
                     extra={"info": {"stamp": stamp, "failures": failures}})
            self.reload_task = asyncio.create_task(self.do_reload(self.served_path()))
            await asyncio.shield(self.reload_task)
            failed = self.reload.state == "failed"
            seen, failures = stamp, failures + 1 if failed else 0

    async def close_routes(self, grace_s: float) -> None:
        """Shutting down: the served routes finish their queued work within `grace_s`, then
        answer what is left with a 503 (while the server still waits to send it)."""
        if self.retriever is not None:
            await self.retriever.close(grace_s)

    def served_path(self) -> Path:
        return self.retriever.bundle.path if self.retriever else self.settings.bundle

    def manifest_stamp(self) -> float | None:
        """The manifest's modification time (it is replaced atomically on every commit)."""
        try:
            return (self.served_path() / MANIFEST).stat().st_mtime
        except OSError:
            return None

    async def retire(self, old: Retriever) -> None:
        """Close a swapped-out retriever once requests holding it are past their deadline."""
        try:
            await asyncio.sleep(self.settings.request_timeout_ms / 1000.0)
        finally:  # shutting down early still closes it
            await old.close()  # freed as the last reference to it goes

    async def do_reload(self, bundle_dir: Path) -> None:
        self.reload = ReloadStatus(state="loading", bundle=str(bundle_dir), started=now_iso())
        try:
            recent = list(self.retriever.recent) if self.retriever else []
            served = list(self.retriever.paths) if self.retriever else []
            old = self.publish(await self.load(bundle_dir, strict=True, traffic=recent,
                                               served=served))
            self.startup, self.startup_error = "ready", None
            self.metrics.ready.set(0 if self.draining else 1)
            self.reload = self.reload.model_copy(update={"state": "succeeded"})
            self.metrics.reloads.labels(outcome="succeeded").inc()
            if old is not None:
                retiring = asyncio.create_task(self.retire(old))
                self.retiring.add(retiring)
                retiring.add_done_callback(self.retiring.discard)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.error("reload refused, still serving the old bundle: %s", error)
            self.reload = self.reload.model_copy(update={"state": "failed", "error": error})
            self.metrics.reloads.labels(outcome="failed").inc()
        finally:
            self.reload = self.reload.model_copy(update={"finished": now_iso()})


def backoff(base_s: float, failures: int) -> float:
    """The wait before the next watch: `base_s`, doubled per consecutive failed reload, at most
    WATCH_BACKOFF_MAX_S (a transient fault is retried soon, a broken bundle rarely)."""
    return min(base_s * 2.0 ** min(failures, 32), max(base_s, WATCH_BACKOFF_MAX_S))


async def in_daemon_thread(nice: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a daemon thread at lowered priority (the ONNX sessions it builds inherit it),
    awaited. A load still running at shutdown is abandoned, not waited for: an executor's
    worker would be joined at exit, holding a SIGTERM'd process until a bundle finished
    loading (its reads change nothing)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not done.done():  # cancelled meanwhile (shutdown)
            outcome()

    def run() -> None:
        yield_to_the_loop(nice)
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting task
            answer = functools.partial(done.set_exception, exc)
        else:
            answer = functools.partial(done.set_result, result)
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, answer)

    threading.Thread(target=run, name="r4t-load", daemon=True).start()
    return await done


def check_limits(query: RetrieveRequest, settings: Settings, retriever: Retriever) -> None:
    """Refuse what the served bundle cannot answer before it takes a batcher's time."""
    if len(query.query) > settings.max_query_chars:
        raise InputError(f"query has {len(query.query)} characters; at most "
                         f"{settings.max_query_chars} are accepted")
    max_k = min(settings.max_k, len(retriever.bundle.items))
    if query.k > max_k:
        raise InputError(f"k={query.k} exceeds the maximum of {max_k}")


def asked(request: RetrieveRequest) -> RouteQuery:
    """The HTTP body as the one request type the retriever and the routes read."""
    return RouteQuery(request.query, request.k, route=request.route, user_id=request.user_id,
                      fanout=request.fanout, filter=request.filter)
