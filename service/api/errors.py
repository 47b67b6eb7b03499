"""Errors → HTTP, in one place: the project's hierarchy (service.errors), invalid input and
stray exceptions each become one JSON envelope, so every failure reads the same to a client."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from service.api.middleware import current_request_id
from service.api.schemas import ErrorResponse
from service.errors import OverloadError, R4TError
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger("r4t.app")

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
    """The one JSON envelope every failure answers with (its request id ties it to the log)."""
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
