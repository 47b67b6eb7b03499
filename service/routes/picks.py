"""What the routes that pick catalog items themselves (`ranked`, `hybrid`) share: how a pick
becomes the served answer. Each route says only how it chooses rows (`choose`); under a
metadata filter the picks are probes resolved among the allowed items, as the diffusion
route's rows; a short answer is filled from the query's dense neighbours."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.artifacts.bundle import Bundle
from service.routes.answer import RouteAnswer, RouteQuery, StageClock, selection_notes, stamp
from service.routes.resolution import Selection, fill_short, lead_with_nearest, resolve_items
from service.routes.route import Route
from service.runtime.encoder import Encoder


class PickingRoute(Route):
    """Query → up to k chosen catalog rows (the subclass's `choose`) → the served answer."""

    name = ""
    choice_stage = "choose"  # the stage timing `choose` is reported under

    def __init__(self, bundle: Bundle, encoder: Encoder) -> None:
        self.bundle, self.encoder = bundle, encoder
        self.providers = [bundle.index.backend]

    def choose(self, texts: Sequence[str], queries: np.ndarray, ks: Sequence[int]
               ) -> list[np.ndarray]:
        """Per query (texts, embeddings (Q, d)), up to k distinct catalog rows, in pick order."""
        raise NotImplementedError

    def __call__(self, batch: Sequence[RouteQuery]) -> list[RouteAnswer]:
        clock = StageClock()
        texts, ks = [q.text for q in batch], [q.k for q in batch]
        queries = self.encoder.encode(texts)  # (B, d)
        clock.lap("encode")
        chosen = self.choose(texts, queries, ks)
        clock.lap(self.choice_stage)
        selections = self._served(batch, queries, chosen)
        clock.lap("search")
        embeddings = self.bundle.items.embeddings
        answers = [RouteAnswer(selection, 1.0, embeddings[rows] if len(rows) else queries[i:i + 1],
                              notes=selection_notes(selection))
                   for i, (selection, rows) in enumerate(zip(selections, chosen, strict=True))]
        clock.lap("postprocess")
        return stamp(answers, clock)

    def _served(self, batch: Sequence[RouteQuery], queries: np.ndarray,
                chosen: list[np.ndarray]) -> list[Selection]:
        """The picks as answered: resolved among the allowed items under a filter, filled when
        short, led by the query's nearest where asked."""
        index, embeddings = self.bundle.index, self.bundle.items.embeddings
        ks, wheres = [q.k for q in batch], [q.where for q in batch]
        selections = [Selection(rows.tolist(), [1.0] * len(rows), list(range(len(rows))))
                      for rows in chosen]
        filtered = [i for i, where in enumerate(wheres) if where is not None]
        if filtered:  # the picks as probes, each claiming its nearest allowed item
            claimed, _ = resolve_items(index, [embeddings[chosen[i]] for i in filtered],
                                       queries[filtered], [ks[i] for i in filtered],
                                       wheres=[wheres[i] for i in filtered])
            for i, selection in zip(filtered, claimed, strict=True):
                selections[i] = selection
        fill_short(index, selections, queries, ks,
                   [i for i, where in enumerate(wheres) if where is None])
        lead_with_nearest(index, selections, queries, [q.lead for q in batch], wheres)
        return selections
