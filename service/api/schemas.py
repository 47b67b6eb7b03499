"""Request and response bodies of the HTTP API, with the examples shown in the OpenAPI schema.

The caps (service/limits.py) are the hard limits of the schema; `Settings` may lower them per
deployment (the handler then answers 422 with the configured limit in the message).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.limits import (
    MAX_BATCH_QUERIES,
    MAX_FILTER_FIELDS,
    MAX_K,
    MAX_QUERY_CHARS,
    MAX_USER_ID_CHARS,
)
from service.routes import ROUTE_ORDER
from service.scheduling.trigger import FanoutMode

ServedRoute = Literal[ROUTE_ORDER]  # the names of service.scheduling.routing, best first
Route = Literal[("auto", *ROUTE_ORDER)]

RETRIEVE_EXAMPLE = {"query": "camping gear", "k": 10, "route": "auto", "user_id": "user-42"}


class RetrieveRequest(BaseModel):
    """One broad query to fan out into k complementary catalog items."""

    model_config = ConfigDict(
        strict=True, extra="forbid", json_schema_extra={"examples": [RETRIEVE_EXAMPLE]}
    )

    query: str = Field(
        min_length=1, max_length=MAX_QUERY_CHARS, description="Broad query text (not blank)."
    )
    k: int = Field(10, ge=1, le=MAX_K, description="Number of distinct items to return.")
    route: Route = Field(
        "auto", description="'auto' follows the A/B weights among the loaded routes; "
        f"{', '.join(map(repr, ROUTE_ORDER))} force one ('single': one dense query)."
    )
    fanout: FanoutMode = Field(
        "auto", description="With route 'auto': 'auto' fans out only a broad query (a narrow "
        "one gets `single`), 'always' follows the A/B arm, 'never' answers with `single`."
    )
    user_id: str | None = Field(
        None, max_length=MAX_USER_ID_CHARS, description="Sticky A/B assignment key."
    )
    filter: dict[str, str | int | float | bool] | None = Field(
        None, max_length=MAX_FILTER_FIELDS,
        description="Only items whose catalog metadata has each field equal to its value "
        "(applied in the index engine: k items whenever k match).",
    )

    @field_validator("query")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        text = " ".join(value.split())
        if not text:
            raise ValueError("query must contain non-whitespace text")
        return text


class BatchRequest(BaseModel):
    """Up to MAX_BATCH_QUERIES queries answered in one call, each as by /v1/retrieve."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        json_schema_extra={
            "examples": [{"queries": [RETRIEVE_EXAMPLE, {"query": "kitchen utensils", "k": 5}]}]
        },
    )

    queries: list[RetrieveRequest] = Field(min_length=1, max_length=MAX_BATCH_QUERIES)


class Item(BaseModel):
    id: str = Field(description="Catalog item id.")
    text: str = Field(description="Catalog item text.")
    score: float = Field(description="Cosine of the probe (generated row or sub-query) to it.")
    slot: int | None = Field(
        description="Which probe claimed it; null for a slot filled from the query's own "
        "dense neighbours."
    )


class Fallback(BaseModel):
    used: bool = Field(description="True when a route further down answered: diffusion → AR "
                       "→ single; ranked, or AR by the A/B arm, → single.")
    reason: str | None = Field(
        None, description="unavailable | error | quality (null when not used)."
    )


class FanoutDecision(BaseModel):
    fanout: bool = Field(description="True when the answer was fanned out (the A/B arm "
                         "answered), False when `single` answered.")
    reason: str = Field(description="broad | narrow (score vs threshold), always | never (the "
                        "request's fanout), arm (the A/B arm is single), no-lexical-index.")
    score: float | None = Field(None, description="The query's breadth: ln(1 + catalog texts "
                                "holding every query word).")
    threshold: float | None = Field(None, description="Breadth from which a query fans out.")
    lead: int = Field(0, description="The query's own nearest items the fanned-out answer "
                      "puts first.")


RESPONSE_EXAMPLE = {
    "items": [
        {"id": "02934451", "text": "tent, collapsible shelter: a portable shelter",
         "score": 0.81, "slot": 0},
    ],
    "route": "diffusion",
    "arm": "diffusion",
    "fallback": {"used": False, "reason": None},
    "fanout": {"fanout": True, "reason": "broad", "score": 4.2, "threshold": 3.1, "lead": 1},
    "bundle": "default",
    "groundedness": 0.78,
    "notes": [],
    "timings_ms": {"queue": 1.2, "encode": 0.4, "context": 1.8, "solver": 6.1, "search": 0.5,
                   "postprocess": 0.2, "total": 10.2},
}


class RetrieveResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [RESPONSE_EXAMPLE]})

    items: list[Item] = Field(description="Exactly k distinct items (fewer only when fewer "
                              "match the request's filter).")
    route: ServedRoute = Field(description="The route that answered.")
    arm: str = Field(description="A/B arm: a route name, or 'override' when route was forced.")
    fallback: Fallback
    fanout: FanoutDecision | None = Field(
        None, description="route=auto: whether and why the query was fanned out; null when "
        "the request forced a route.")
    bundle: str = Field(description="Name of the bundle that answered.")
    groundedness: float = Field(description="Mean cos of the probes to their nearest items "
                                "among those they may claim (diffusion: its context's).")
    notes: list[str] = Field(default_factory=list, description="Anything worth knowing.")
    subqueries: list[str] = Field(
        default_factory=list, description="AR: the fan-out's usable sub-queries; item slot i "
        "was found by subqueries[i]. Empty for the other routes.")
    timings_ms: dict[str, float] = Field(description="Milliseconds per stage, and total.")


class BatchResponse(BaseModel):
    results: list[RetrieveResponse]


class ErrorBody(BaseModel):
    type: str = Field(description="Error class, e.g. InputError, OverloadError.")
    message: str
    details: list[dict] | None = None


class ErrorResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"error": {"type": "OverloadError",
                                                   "message": "diffusion queue is full"}}]}
    )

    error: ErrorBody
    request_id: str | None = None


class ReloadRequest(BaseModel):
    model_config = ConfigDict(
        strict=True, extra="forbid", json_schema_extra={"examples": [{"bundle": "models/v2"}]}
    )

    bundle: str | None = Field(None, description="Bundle folder; default: the served one.")
    wait: bool = Field(False, description="Answer when the reload finished instead of 202.")


class ReloadStatus(BaseModel):
    state: Literal["idle", "loading", "succeeded", "failed"]
    bundle: str | None = None
    error: str | None = None
    started: str | None = None
    finished: str | None = None
