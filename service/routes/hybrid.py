"""The `hybrid` route: the first k names of the query's hybrid candidate list (lexical and
dense fused by rank, the query's own name skipped), as the AR policy's prompt lists them. No
model at all: the cheapest fan-out, and the free heuristic every learned route must beat on a
bundle's own val split (training/evaluation/routes.py) to be served by default."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from service.artifacts.bundle import Bundle
from service.errors import BundleError
from service.fanout.candidates import Candidates
from service.fanout.format import PROMPT_RECIPE
from service.fanout.grounding import PromptNeighbourhood
from service.routes.picks import PickingRoute
from service.runtime.encoder import Encoder
from service.runtime.segments import first_occurrences

SOURCE = "hybrid"


class HybridRoute(PickingRoute):
    """Query → its first k distinct hybrid candidates' names, grounded to their items."""

    name = "hybrid"
    choice_stage = "candidates"

    def __init__(self, bundle: Bundle, encoder: Encoder) -> None:
        if bundle.lexical is None:
            raise BundleError("bundle has no lexical index (the hybrid list needs one)")
        super().__init__(bundle, encoder)
        self.lookup = PromptNeighbourhood(Candidates.of(bundle, SOURCE), bundle.items.texts,
                                          bundle.items.embeddings, PROMPT_RECIPE.context)

    def describe(self) -> dict[str, Any]:
        return {"providers": self.providers, "candidates": SOURCE,
                "context": PROMPT_RECIPE.context}

    def choose(self, texts: Sequence[str], queries: np.ndarray, ks: Sequence[int]
               ) -> list[np.ndarray]:
        """A prompt of max(k, the recipe's context) names, its first k (distinct: a short
        neighbourhood repeats its names to fill the prompt)."""
        rows = self.lookup.rows(texts, queries, max(self.lookup.n, *ks))  # (Q, n)
        first = first_occurrences(rows)  # (Q, n)
        return [row[keep][:k] for row, keep, k in zip(rows, first, ks, strict=True)]
