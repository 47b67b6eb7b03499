"""The HTTP API: `create_app(settings) -> FastAPI`.

Start-up loads the bundle in the background (verify, load runtimes, warm up every path);
/healthz answers at once, /readyz turns 200 when warm-up ends and lists the routes served.
With `watch_s` set, a bundle that is still being built is reloaded as each stage lands.
Errors of the project's hierarchy (service.errors) are mapped to HTTP here, in one place, with
one JSON envelope.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from service.api.middleware import (
    ARRIVAL_KEY,
    AdmissionGate,
    BodyGuard,
    RequestContext,
    current_request_id,
)
from service.api.playground import install_playground
from service.api.responses import retrieve_response
from service.api.schemas import (
    BatchRequest,
    BatchResponse,
    ErrorResponse,
    ReloadRequest,
    ReloadStatus,
    RetrieveRequest,
    RetrieveResponse,
)
from service.artifacts.bundle import MANIFEST, now_iso, read_build_status
from service.errors import (
    IndexUnavailableError,
    InputError,
    OverloadError,
    R4TError,
    UnavailableError,
)
from service.metrics import Metrics
from service.runtime.index import IndexChoice
from service.scheduling.batching import yield_to_the_loop
from service.scheduling.retriever import Loaders, Retrieval, Retriever
from service.settings import Settings

log = logging.getLogger("r4t.app")
T = TypeVar("T")
GATE_HEADROOM = 1.5  # the gate admits this many times the concurrency answered successfully
ENGINE_RETRY_S = 2.0  # how often a start-up refused for its index engine being down retries
WATCH_BACKOFF_MAX_S = 60.0  # the longest wait before a failed watched reload is tried again
CLIENT_GONE = 499  # nginx's "client closed request": logged, never seen by the client

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text} for code, text in (
        (413, "Body too large"), (422, "Invalid input"), (429, "Queue full; see Retry-After"),
        (503, "Not ready or route unavailable"), (504, "Deadline passed"),
    )
}


def error_response(
    status: int, kind: str, message: str, details: list[dict] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    error: dict[str, Any] = {"type": kind, "message": message}
    if details is not None:
        error["details"] = details
    content = {"error": error, "request_id": current_request_id()}
    return JSONResponse(content, status_code=status, headers=headers)


def _validation_details(exc: RequestValidationError) -> tuple[str, list[dict]]:
    """Short, input-free messages ("body.k: Input should be ...") — never echo a 100 KB body."""
    details = []
    for error in exc.errors():
        loc = ".".join(str(part) for part in error.get("loc", ()))
        msg = str(error.get("msg", "invalid"))
        if error.get("type") == "json_invalid":
            msg = f"request body is not valid JSON ({error.get('ctx', {}).get('error', msg)})"
        details.append({"loc": loc, "message": msg, "type": str(error.get("type", ""))})
    summary = "; ".join(f"{d['loc']}: {d['message']}" for d in details[:5]) or "invalid request"
    return summary, details


def install_error_handlers(app: FastAPI, metrics: Metrics, settings: Settings) -> None:
    """The single place where exceptions become HTTP responses."""

    @app.exception_handler(R4TError)
    async def on_r4t_error(request: Request, exc: R4TError) -> JSONResponse:
        headers = None
        if isinstance(exc, OverloadError):
            wait_s = max(settings.retry_after_s, math.ceil(exc.retry_after_s))
            headers = {"Retry-After": str(wait_s)}
        metrics.rejected.labels(reason=type(exc).__name__).inc()
        return error_response(exc.http_status, type(exc).__name__, str(exc), headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected.labels(reason="InvalidInput").inc()
        summary, details = _validation_details(exc)
        return error_response(422, "InputError", summary, details)

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, "HTTPError", str(exc.detail),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, "InternalError", "internal error; see the server log")


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

    async def load(self, bundle_dir: Path, strict: bool, traffic: Sequence[str] = ()
                   ) -> Retriever:
        retriever = await in_daemon_thread(self.settings.compute_nice, Retriever.load,
                                           self.settings, self.metrics, bundle_dir, self.loaders)
        retriever.start()
        try:
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
            served = await retriever.retrieve(Retrieval(**query.model_dump()), deadline)
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
            log.info("bundle changed on disk, its index engine was down or its last reload "
                     "failed: reloading", extra={"info": {"stamp": stamp, "failures": failures}})
            self.reload_task = asyncio.create_task(self.do_reload(self.served_path()))
            await asyncio.shield(self.reload_task)
            failed = self.reload.state == "failed"
            seen, failures = stamp, failures + 1 if failed else 0

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
            old = self.publish(await self.load(bundle_dir, strict=True, traffic=recent))
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


async def until_disconnect(request: Request, work: Awaitable[T], metrics: Metrics) -> T | Response:
    """Await `work` unless the client goes away first (then cancel it: its jobs get skipped)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():  # the client left first
        with contextlib.suppress(asyncio.CancelledError, R4TError):
            await task
        metrics.rejected.labels(reason="ClientGone").inc()
        return Response(status_code=CLIENT_GONE)
    return task.result()


def check_limits(query: RetrieveRequest, settings: Settings, retriever: Retriever) -> None:
    if len(query.query) > settings.max_query_chars:
        raise InputError(f"query has {len(query.query)} characters; at most "
                         f"{settings.max_query_chars} are accepted")
    max_k = min(settings.max_k, len(retriever.bundle.items))
    if query.k > max_k:
        raise InputError(f"k={query.k} exceeds the maximum of {max_k}")


def check_admin(settings: Settings, authorization: str | None) -> None:
    if settings.admin_token is None:
        raise HTTPException(403, "the admin API is disabled (R4T_ADMIN_TOKEN is not set)")
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
    if not secrets.compare_digest(token.encode(), settings.admin_token.get_secret_value().encode()):
        raise HTTPException(403, "invalid admin token")


def create_app(settings: Settings | None = None, loaders: Loaders | None = None) -> FastAPI:
    """Build the app; the bundle loads in the background once the server starts."""
    settings = settings or Settings()
    state = ServiceState(settings, loaders or Loaders())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(state.start())
        retries = IndexChoice.parse(settings.index).engine  # a start with the engine down
        watching = [asyncio.create_task(state.watch())] if settings.watch_s > 0 or retries \
            else []
        yield
        tasks = [starting, *watching, *state.retiring]
        if state.reload_task is not None:
            tasks.append(state.reload_task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # let retire() close what it holds
        if state.retriever is not None:
            await state.retriever.close()

    app = FastAPI(
        title="r4t retrieval service",
        version="0.1.0",
        summary="Fan-out retrieval: a broad query in, k complementary catalog items out.",
        lifespan=lifespan,
    )
    app.state.r4t = state
    install_error_handlers(app, state.metrics, settings)
    install_routes(app, state)
    app.add_middleware(BodyGuard, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(RequestContext)
    return app


def gated(app: FastAPI) -> AdmissionGate:
    """The app behind its admission gate, outside every FastAPI layer: what the server runs,
    so that a refusal under overload costs the event loop as little as it can."""
    state: ServiceState = app.state.r4t
    settings = state.settings
    def reject(duration_s: float) -> None:  # counted as every answer is (R4THighRejectRate)
        state.metrics.rejected.labels(reason="OverloadError").inc()
        state.metrics.request_duration.labels(route="none", arm="none",
                                              status="429").observe(duration_s)

    return AdmissionGate(
        app, max_in_flight=settings.max_in_flight, retry_after_s=settings.retry_after_s,
        prefix="/v1/retrieve", on_reject=reject,
        headroom=GATE_HEADROOM,
        floor=settings.queue_size // 2,  # bursts this large always reach the batchers
    )


def install_routes(app: FastAPI, state: ServiceState) -> None:
    settings, metrics = state.settings, state.metrics

    @app.get("/healthz", tags=["ops"], summary="The process is alive.")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz", tags=["ops"], summary="200 once the bundle is loaded and warmed up.",
             responses={503: {"description": "Loading, or start-up failed"}})
    async def readyz() -> JSONResponse:
        building = (read_build_status(state.served_path()) or {}).get("state") == "running"
        if state.draining:
            return JSONResponse({"status": "draining", "reason": "shutting down (SIGTERM)",
                                 "building": building}, status_code=503)
        if state.retriever is None:
            body = {"status": state.startup, "reason": state.startup_error, "building": building}
            return JSONResponse(body, status_code=503)
        index = state.retriever.bundle.index
        if index.backend != "faiss":  # an external engine: ready only while it answers
            try:
                await asyncio.to_thread(index.check)
            except IndexUnavailableError as exc:
                return JSONResponse({"status": "index unavailable", "reason": str(exc),
                                     "building": building}, status_code=503)
        return JSONResponse({"status": "ready", "bundle": state.retriever.bundle.name,
                             "routes": state.retriever.routes, "building": building})

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics.")
    async def prometheus() -> Response:
        payload, content_type = metrics.exposition()
        return Response(payload, media_type=content_type)

    @app.get("/v1/info", tags=["ops"], summary="Bundle manifest, providers, routing, settings.")
    async def info() -> dict[str, Any]:
        served = state.retriever.info() if state.retriever is not None else None
        return {"status": state.startup, "startup_error": state.startup_error,
                "settings": settings.public(), "served": served,
                "reload": state.reload.model_dump(),
                "build": read_build_status(state.served_path())}

    install_retrieval(app, state)
    install_admin(app, state)
    install_playground(app)


def install_retrieval(app: FastAPI, state: ServiceState) -> None:
    settings, metrics = state.settings, state.metrics

    @app.post("/v1/retrieve", tags=["retrieval"], response_model=RetrieveResponse,
              responses=ERRORS, summary="k distinct complementary items for one query.")
    async def retrieve(body: RetrieveRequest, request: Request) -> Any:
        metrics.in_flight.inc()
        try:
            result = await until_disconnect(request, state.answer(request, [body]), metrics)
        finally:
            metrics.in_flight.dec()
        if isinstance(result, Response):
            return result
        return Response(result[0].model_dump_json(), media_type="application/json")

    @app.post("/v1/retrieve:batch", tags=["retrieval"], response_model=BatchResponse,
              responses=ERRORS, summary="Up to N queries in one call, each as /v1/retrieve.")
    async def retrieve_batch(body: BatchRequest, request: Request) -> Any:
        if len(body.queries) > settings.max_batch_queries:
            raise InputError(f"{len(body.queries)} queries; at most "
                             f"{settings.max_batch_queries} per batch call")
        metrics.in_flight.inc(len(body.queries))
        try:
            result = await until_disconnect(request, state.answer(request, body.queries), metrics)
        finally:
            metrics.in_flight.dec(len(body.queries))
        if isinstance(result, Response):
            return result
        return Response(BatchResponse(results=result).model_dump_json(),
                        media_type="application/json")


def install_admin(app: FastAPI, state: ServiceState) -> None:
    settings = state.settings

    @app.post("/admin/reload", tags=["admin"], response_model=ReloadStatus, status_code=202,
              summary="Load, verify and warm up a bundle, then swap it in atomically.",
              responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse},
                         409: {"model": ErrorResponse}, 422: {"model": ErrorResponse},
                         200: {"model": ReloadStatus, "description": "wait=true: done"}})
    async def reload(body: ReloadRequest | None = None,
                     authorization: str | None = Header(None)) -> Any:
        check_admin(settings, authorization)
        body = body or ReloadRequest()
        if state.reload_task is not None and not state.reload_task.done():
            raise HTTPException(409, "a reload is already running")
        if state.startup == "loading":  # start-up would publish its bundle over the reload's
            raise HTTPException(409, "the service is still loading its start-up bundle")
        current = state.retriever.bundle.path if state.retriever else settings.bundle
        target = Path(body.bundle) if body.bundle else current
        state.reload = ReloadStatus(state="loading", bundle=str(target), started=now_iso())
        state.reload_task = asyncio.create_task(state.do_reload(target))
        if not body.wait:
            return state.reload
        await asyncio.shield(state.reload_task)
        if state.reload.state != "succeeded":
            return error_response(422, "BundleError", f"reload refused, still serving the "
                                  f"old bundle: {state.reload.error}", [state.reload.model_dump()])
        return JSONResponse(state.reload.model_dump(), status_code=200)

    @app.get("/admin/reload", tags=["admin"], response_model=ReloadStatus,
             summary="Status of the last reload.",
             responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}})
    async def reload_status(authorization: str | None = Header(None)) -> ReloadStatus:
        check_admin(settings, authorization)
        return state.reload
