"""The `single` route: one dense query, the floor every other route is measured against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from service.artifacts.bundle import Bundle
from service.routes.answer import RouteAnswer, RouteQuery, StageClock, stamp
from service.routes.resolution import Selection
from service.routes.route import Route
from service.runtime.encoder import Encoder
from service.runtime.index import search_each


class SingleRoute(Route):
    """Query embedding → its k nearest items: one dense query, the floor of every route."""

    name = "single"

    def __init__(self, bundle: Bundle, encoder: Encoder) -> None:
        self.bundle, self.encoder = bundle, encoder
        self.providers = [bundle.index.backend]

    def describe(self) -> dict[str, Any]:
        return {"providers": self.providers, "index": self.bundle.index.describe()}

    def __call__(self, batch: Sequence[RouteQuery]) -> list[RouteAnswer]:
        clock = StageClock()
        queries = self.encoder.encode([q.text for q in batch])  # (B, d)
        clock.lap("encode")
        scores, rows = search_each(self.bundle.index, queries, max(q.k for q in batch),
                                   [q.where for q in batch])  # (B, k)
        clock.lap("search")
        answers = []
        for query, probe, found, score in zip(batch, queries, rows, scores, strict=True):
            keep = found[: query.k] >= 0
            selection = Selection(found[: query.k][keep].tolist(),
                                  score[: query.k][keep].tolist(), [0] * int(keep.sum()))
            grounded = float(np.clip(score[0], 0.0, 1.0)) if len(score) else 0.0
            answers.append(RouteAnswer(selection, grounded, probe[None]))  # (1, d) probe
        clock.lap("postprocess")
        return stamp(answers, clock)
