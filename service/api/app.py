"""The HTTP API: `create_app(settings) -> FastAPI`.

Start-up loads the bundle in the background, so /healthz answers at once and /readyz turns 200
when every path is warm; `watch_s` reloads a bundle still being built as each stage lands.
Errors map to HTTP in service/api/errors.py; the served state lives in service/api/state.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from service.api.errors import ERRORS, error_response, install_error_handlers
from service.api.middleware import AdmissionGate, BodyGuard, RequestContext
from service.api.playground import install_playground
from service.api.schemas import (
    BatchRequest,
    BatchResponse,
    ErrorResponse,
    ReloadRequest,
    ReloadStatus,
    RetrieveRequest,
    RetrieveResponse,
)
from service.api.state import ServiceState
from service.artifacts.bundle import now_iso
from service.artifacts.progress import read_build_status
from service.errors import IndexUnavailableError, InputError, R4TError
from service.metrics import Metrics
from service.runtime.index import IndexChoice
from service.scheduling.assembly import Loaders
from service.settings import Settings

T = TypeVar("T")
GATE_HEADROOM = 1.5  # the gate admits this many times the concurrency answered successfully
CLIENT_GONE = 499  # nginx's "client closed request": logged, never seen by the client


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


def check_admin(settings: Settings, request: Request, authorization: str | None) -> None:
    """The admin API answers only the configured bearer token (compared in constant time),
    and with R4T_ADMIN_PORT only on that port: elsewhere it does not exist (404)."""
    port = (request.scope.get("server") or (None, None))[1]
    if settings.admin_port is not None and port != settings.admin_port:
        raise HTTPException(404, "Not Found")
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
        max_body_bytes=settings.max_body_bytes,
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
                "reload": {"state": state.reload.state},  # its path and error: /admin/reload
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


def under_models_root(settings: Settings, bundle: str) -> Path:
    """A reload's bundle, relative to the models root or absolute inside it; else a 422."""
    root = settings.models_root_path()
    target = (root / bundle).resolve()
    if not target.is_relative_to(root):
        raise InputError(f"bundle {bundle!r} is outside the models root {root} "
                         "(R4T_MODELS_ROOT)")
    return target


def install_admin(app: FastAPI, state: ServiceState) -> None:
    settings = state.settings

    @app.post("/admin/reload", tags=["admin"], response_model=ReloadStatus, status_code=202,
              summary="Load, verify and warm up a bundle, then swap it in atomically.",
              responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse},
                         409: {"model": ErrorResponse}, 422: {"model": ErrorResponse},
                         200: {"model": ReloadStatus, "description": "wait=true: done"}})
    async def reload(request: Request, body: ReloadRequest | None = None,
                     authorization: str | None = Header(None)) -> Any:
        check_admin(settings, request, authorization)
        body = body or ReloadRequest()
        if state.reload_task is not None and not state.reload_task.done():
            raise HTTPException(409, "a reload is already running")
        if state.startup == "loading":  # start-up would publish its bundle over the reload's
            raise HTTPException(409, "the service is still loading its start-up bundle")
        current = state.retriever.bundle.path if state.retriever else settings.bundle
        target = under_models_root(settings, body.bundle) if body.bundle else current
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
    async def reload_status(request: Request,
                            authorization: str | None = Header(None)) -> ReloadStatus:
        check_admin(settings, request, authorization)
        return state.reload
