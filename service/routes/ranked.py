"""The `ranked` route: encode → candidates from the hybrid list and the catalog's mentions →
features → the bundle's ranker scores them → k picked greedily, redundancy-penalised
(service.ranker.ranker). No generative model: a few ms of CPU per query."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from service.artifacts.bundle import Bundle
from service.ranker.mentions import MentionFeatures
from service.ranker.ranker import Ranker, ScoredCandidates
from service.routes.picks import PickingRoute
from service.runtime.encoder import Encoder


class RankedRoute(PickingRoute):
    """Query → its candidates' features → ranker scores → k complementary items."""

    name = "ranked"
    choice_stage = "rank"

    def __init__(self, bundle: Bundle, encoder: Encoder, ranker: Ranker | None = None,
                 features: MentionFeatures | None = None,
                 scored: ScoredCandidates | None = None) -> None:
        """`scored`: the bundle's ranker, built once by the assembly; else one of `ranker`
        (default: the bundle's) over `features`."""
        super().__init__(bundle, encoder)
        self.scored = scored or ScoredCandidates(bundle, ranker, features)
        self.ranker, self.features = self.scored.ranker, self.scored.features

    def describe(self) -> dict[str, Any]:
        return {"providers": self.providers, "config": self.ranker.config.to_dict()}

    def choose(self, texts: Sequence[str], queries: np.ndarray, ks: Sequence[int]
               ) -> list[np.ndarray]:
        scored = self.scored(texts, queries)
        picks = self.ranker.choose_each([s for _, s in scored], [rows for rows, _ in scored], ks,
                                        self.bundle.items.embeddings)
        return [rows[p] for (rows, _), p in zip(scored, picks, strict=True)]
