"""What every retrieval path returns: per query, k distinct items, the probes they were
resolved from, their groundedness and the batch's per-stage timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.routes.resolution import Selection
from service.runtime.filters import Where


@dataclass(frozen=True)
class RouteQuery:
    """One request past the HTTP layer: what a route reads (text, k, where, lead, deadline) and
    what the retriever routes it by (route, user_id, fanout, filter as asked)."""

    text: str
    k: int
    where: Where | None = None  # metadata filter on the returned items
    lead: int = 0  # fan-out routes: the query's own nearest items put first (route=auto)
    deadline: float | None = None  # time.monotonic() by which it is due (None: unbounded)
    route: str = "auto"  # "auto" (A/B arm and fan-out trigger) or a route name
    user_id: str | None = None  # the sticky A/B key
    fanout: str = "auto"  # route=auto: "auto" fans out a broad query only, or always / never
    filter: dict[str, Any] | None = field(default=None, hash=False)  # as asked: becomes `where`


@dataclass
class RouteAnswer:
    selection: Selection
    groundedness: float
    probes: np.ndarray  # (P, d) what the items were resolved from; slot i is probes[i]
    timings_s: dict[str, float] = field(default_factory=dict)  # stages of the whole batch
    notes: list[str] = field(default_factory=list)
    well_formed: bool = True  # False: a malformed fan-out (its probes are the usable lines)
    subqueries: list[str] = field(default_factory=list)  # AR: the usable fan-out lines
    tokens: int = 0  # AR: tokens the fan-out model generated for this query
    cached: bool = False  # AR: the fan-out came from the expansion cache


def selection_notes(selection: Selection) -> list[str]:
    """What an answer says of its items that no probe claimed."""
    notes = []
    if selection.led:
        notes.append(f"led by the query's own {selection.led} nearest item(s) (route=auto)")
    if selection.filled:
        notes.append(f"{selection.filled} slots filled from the query's dense neighbours")
    return notes


class StageClock:
    """Wall time per named stage, measured lap by lap."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.timings[stage] = self.timings.get(stage, 0.0) + now - self._last
        self._last = now


def searched_s(timings_s: dict[str, float]) -> float:
    """Seconds a batch spent searching the catalog: its context lookup and its resolution."""
    return timings_s.get("context", 0.0) + timings_s.get("search", 0.0)


def stamp(answers: list[RouteAnswer], clock: StageClock) -> list[RouteAnswer]:
    """Give every answer of a batch the batch's stage timings."""
    for answer in answers:
        answer.timings_s = clock.timings
    return answers
