"""The playground: `GET /` serves a page that asks /v1/retrieve for the single, diffusion and
AR routes side by side and shows /v1/info. Static HTML and plain JS in `static/`, shipped in
the package: no build step, no CDN, nothing it shows needs the admin API."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).with_name("static")


def install_playground(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")
