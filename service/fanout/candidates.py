"""Candidate generation: the catalog rows a fan-out may choose from, by source.

- "dense": the query's nearest items (one FAISS search);
- "lexical": the items whose text shares a word with the query, best BM25 first (the bundle's
  `lexical.sqlite`, service.artifacts.lexical);
- "hybrid": the two fused by reciprocal rank (RRF, k=60), so an item found by both comes first.
One function for the teacher's prompt, the student's context, the service and evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.artifacts.bundle import Bundle
from service.errors import BundleError
from service.runtime.index import search

CANDIDATE_SOURCES = ("dense", "lexical", "hybrid")
RRF_K = 60  # reciprocal-rank fusion's damping constant (Cormack et al. 2009)


def candidate_rows(bundle: Bundle, texts: Sequence[str], queries: np.ndarray, n: int,
                   source: str = "dense") -> list[np.ndarray]:
    """Per query (texts and embeddings (Q, d)), up to n distinct catalog rows, best first."""
    if source not in CANDIDATE_SOURCES:
        raise BundleError(f"unknown candidate source {source!r}; use one of {CANDIDATE_SOURCES}")
    if source == "dense":
        _, rows = search(bundle.index, queries, n)  # (Q, n)
        return [r[r >= 0] for r in rows]
    if bundle.lexical is None:
        raise BundleError(f"candidate source {source!r} needs the bundle's lexical index: "
                          "run `r4t bundle` (or `r4t catalog`) to build it")
    lexical = bundle.lexical.search(texts, n)
    if source == "lexical":
        return lexical
    _, dense = search(bundle.index, queries, n)  # (Q, n)
    return [fuse([lex, near[near >= 0]], n) for lex, near in zip(lexical, dense, strict=True)]


def fuse(rankings: Sequence[np.ndarray], n: int) -> np.ndarray:
    """Reciprocal-rank fusion of ranked row lists: the first n rows by Σ 1 / (RRF_K + rank)."""
    score: dict[int, float] = {}
    for ranking in rankings:
        for rank, row in enumerate(ranking.tolist()):
            score[row] = score.get(row, 0.0) + 1.0 / (RRF_K + rank + 1)
    ordered = sorted(score, key=lambda row: -score[row])  # stable: ties keep first-seen order
    return np.asarray(ordered[:n], dtype=np.int64)
