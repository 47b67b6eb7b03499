"""The `ranked` route: encode → candidates from the hybrid list and the catalog's mentions →
features → the bundle's ranker scores them → k picked greedily, redundancy-penalised
(service.fanout.ranker). No generative model: a few ms of CPU per query. Under a metadata
filter the picks are probes resolved among the allowed items, as the diffusion route's rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from service.artifacts.bundle import Bundle
from service.fanout.ranker import Ranker, ScoredCandidates
from service.routes.answer import RouteAnswer, RouteQuery, StageClock, selection_notes, stamp
from service.routes.resolution import Selection, fill_short, lead_with_nearest, resolve_items
from service.runtime.encoder import Encoder


class RankedRoute:
    """Query → its candidates' features → ranker scores → k complementary items."""

    name = "ranked"

    def __init__(self, bundle: Bundle, encoder: Encoder, ranker: Ranker | None = None) -> None:
        self.bundle, self.encoder = bundle, encoder
        self.scored = ScoredCandidates(bundle, ranker)
        self.ranker, self.features = self.scored.ranker, self.scored.features
        self.providers = [bundle.index.backend]

    def describe(self) -> dict[str, Any]:
        return {"providers": self.providers, "config": self.ranker.config.to_dict()}

    def choose(self, texts: Sequence[str], queries: np.ndarray, ks: Sequence[int]
               ) -> list[np.ndarray]:
        """Per query (texts, embeddings (Q, d)), up to k chosen catalog rows, in pick order."""
        embeddings = self.bundle.items.embeddings
        return [rows[self.ranker.choose(scores, embeddings[rows], k)]
                for k, (rows, scores) in zip(ks, self.scored(texts, queries), strict=True)]

    def __call__(self, batch: Sequence[RouteQuery]) -> list[RouteAnswer]:
        clock = StageClock()
        texts, ks = [q.text for q in batch], [q.k for q in batch]
        queries = self.encoder.encode(texts)  # (B, d)
        clock.lap("encode")
        chosen = self.choose(texts, queries, ks)
        clock.lap("rank")
        embeddings = self.bundle.items.embeddings
        selections = [Selection(rows.tolist(), [1.0] * len(rows), list(range(len(rows))))
                      for rows in chosen]
        wheres = [q.where for q in batch]
        filtered = [i for i, where in enumerate(wheres) if where is not None]
        if filtered:  # the picks as probes, each claiming its nearest allowed item
            claimed, _ = resolve_items(self.bundle.index, [embeddings[chosen[i]] for i in filtered],
                                       queries[filtered], [ks[i] for i in filtered],
                                       wheres=[wheres[i] for i in filtered])
            for i, selection in zip(filtered, claimed, strict=True):
                selections[i] = selection
        fill_short(self.bundle.index, selections, queries, ks,
                   [i for i, where in enumerate(wheres) if where is None])
        lead_with_nearest(self.bundle.index, selections, queries, [q.lead for q in batch],
                          wheres)
        clock.lap("search")
        answers = [RouteAnswer(selection, 1.0, embeddings[rows] if len(rows) else queries[i:i + 1],
                              notes=selection_notes(selection))
                   for i, (selection, rows) in enumerate(zip(selections, chosen, strict=True))]
        clock.lap("postprocess")
        return stamp(answers, clock)
