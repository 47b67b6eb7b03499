"""Candidate generation by source: "dense" (one FAISS search), "lexical" (BM25 over the texts
sharing a word with the query) or "hybrid" (the two fused by reciprocal rank).

One definition for the teacher's prompt, the student's context, the service and evaluation: a
policy or sampler records its source (`candidates`) and builds its `Candidates` from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from service.artifacts.bundle import Bundle
from service.artifacts.lexical import LexicalIndex
from service.errors import BundleError
from service.runtime.index import search
from service.runtime.segments import first_n_each, spans, sum_by_owner

CANDIDATE_SOURCES = ("dense", "lexical", "hybrid")
# The source a policy, sampler or denoiser config means when it names none: what they used
# before sources existed. Presets all name "hybrid"; this stays "dense" so recorded configs
# (and their hashes) keep meaning what they meant.
UNRECORDED_SOURCE = "dense"
RRF_K = 60  # reciprocal-rank fusion's damping constant (Cormack et al. 2009)


class Candidates:
    """One source's candidate generator over an index (and the lexical index it may need)."""

    def __init__(self, index: Any, lexical: LexicalIndex | None = None,
                 source: str = UNRECORDED_SOURCE) -> None:
        if source not in CANDIDATE_SOURCES:
            raise BundleError(f"unknown candidate source {source!r}; use one of "
                              f"{CANDIDATE_SOURCES}")
        if source != "dense" and lexical is None:
            raise BundleError(f"candidate source {source!r} needs the bundle's lexical index: "
                              "run `r4t bundle` (or `r4t catalog`) to build it")
        self.index, self.lexical, self.source = index, lexical, source

    @classmethod
    def of(cls, bundle: Bundle, source: str | None = None) -> Candidates:
        return cls(bundle.index, bundle.lexical, source or UNRECORDED_SOURCE)

    def rows(self, texts: Sequence[str], queries: np.ndarray, n: int) -> list[np.ndarray]:
        """Per query (texts and embeddings (Q, d)), up to n distinct catalog rows, best first."""
        if self.source == "dense":
            return dense_rows(self.index, queries, n)
        assert self.lexical is not None  # checked in __init__
        lexical = self.lexical.search(texts, n)
        if self.source == "lexical":
            return lexical
        return fuse_each([lexical, dense_rows(self.index, queries, n)], n)


def dense_rows(index: Any, queries: np.ndarray, n: int) -> list[np.ndarray]:
    _, rows = search(index, queries, n)  # (Q, n)
    return [r[r >= 0] for r in rows]


def candidate_rows(bundle: Bundle, texts: Sequence[str], queries: np.ndarray, n: int,
                   source: str = UNRECORDED_SOURCE) -> list[np.ndarray]:
    """Per query, up to n distinct catalog rows of `source`, best first."""
    return Candidates.of(bundle, source).rows(texts, queries, n)


def fuse(rankings: Sequence[np.ndarray], n: int) -> np.ndarray:
    """Reciprocal-rank fusion of ranked row lists: the first n rows by Σ 1 / (RRF_K + rank),
    ties in first-seen order."""
    if not rankings:
        return np.zeros(0, dtype=np.int64)
    return fuse_each([[r] for r in rankings], n)[0]


def fuse_each(sources: Sequence[Sequence[np.ndarray]], n: int) -> list[np.ndarray]:
    """`fuse` for a batch at once: sources[s][q] is source s's ranking for query q. Each
    (query, row)'s terms are summed in source order, so the scores (and the order) are exactly
    a running sum's."""
    count = len(sources[0]) if sources else 0
    if any(len(source) != count for source in sources):
        raise ValueError(f"sources rank {[len(s) for s in sources]} queries; expected one each")
    lists = [np.asarray(source[q], dtype=np.int64) for q in range(count) for source in sources]
    if not lists:
        return []
    sizes = np.array([len(r) for r in lists], dtype=np.int64)  # (Q·S,) query-major
    rows = np.concatenate(lists)  # (M,) catalog rows, ≥ 0
    ranking, rank = spans(sizes)  # (M,) each entry's ranking and 0-based rank in it
    owners = ranking // len(sources)  # (M,) each entry's query
    width = int(rows.max()) + 1 if len(rows) else 1
    owner, row, first, score = sum_by_owner(owners, rows, 1.0 / (RRF_K + rank + 1), width)
    order = np.lexsort((first, -score, owner))  # (U,) by query, best first, ties first seen
    return first_n_each(owner[order], row[order], count, n)
