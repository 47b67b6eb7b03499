"""Sub-query grounding: a sub-query that is exactly a catalog item's name stands for that item.

Embedding a bare name loses its item (short names are shared), so a sub-query equal to a name
(case and spacing aside) resolves by lookup, like an id: its probe is that item's embedding,
the one nearest the query among items sharing the name. Serving, the reward, synthesis and
evaluation all resolve through here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from service.fanout.candidates import Candidates
from service.fanout.format import item_name
from service.runtime.segments import best_each, first_occurrences, spans

NOT_A_NAME = -1


def name_key(text: str) -> str:
    return " ".join(text.lower().split())


class NameGrounding:
    """Catalog names → their rows; probes for sub-queries, named ones looked up."""

    def __init__(self, item_texts: Sequence[str], embeddings: np.ndarray) -> None:
        self.embeddings = embeddings  # (N, d) unit rows, row-aligned with the index
        rows_of: dict[str, list[int]] = {}
        for row, text in enumerate(item_texts):
            key = name_key(item_name(text))
            if key:
                rows_of.setdefault(key, []).append(row)
        self._ids = {key: i for i, key in enumerate(rows_of)}
        # the map as arrays: each row's name id (−1: no name); each name's rows, CSR
        # (name i owns _members[_start[i] : _start[i + 1]]); a name's only row (−1: shared)
        self.name_ids = np.full(len(item_texts), NOT_A_NAME, dtype=np.int64)  # (N,)
        members = [np.asarray(rows, dtype=np.int64) for rows in rows_of.values()]
        sizes = np.array([len(m) for m in members], dtype=np.int64)  # (K,)
        self._members = np.concatenate(members) if members else np.zeros(0, np.int64)
        self._start = np.concatenate([[0], np.cumsum(sizes)])  # (K + 1,)
        self.name_ids[self._members] = spans(sizes)[0]  # each member's name
        self._only = (np.where(sizes == 1, self._members[self._start[:-1]], NOT_A_NAME)
                      if len(sizes) else np.zeros(0, np.int64))  # (K,)

    def name_id(self, text: str) -> int:
        """The id of the name `text` is (case and spacing aside), else −1."""
        return self._ids.get(name_key(text), NOT_A_NAME)

    def named_rows(self, ids: np.ndarray, queries: np.ndarray,
                   owners: np.ndarray | None = None) -> np.ndarray:
        """(n,) int64: the item of each name id (n,), −1 where none; a name several items
        share stands for the one nearest its query (first of them on a tie): queries[owners]
        of queries (Q, d), owners (n,) (by default one query per id)."""
        ids = np.asarray(ids, dtype=np.int64)
        owners = np.arange(len(ids)) if owners is None else owners
        rows = np.full(len(ids), NOT_A_NAME, dtype=np.int64)  # (n,)
        named = ids != NOT_A_NAME
        rows[named] = self._only[ids[named]]
        shared = np.flatnonzero(named & (rows == NOT_A_NAME))  # (m,)
        if len(shared):
            rows[shared] = self._nearest_member(ids[shared], queries[owners[shared]])
        return rows

    def _nearest_member(self, ids: np.ndarray, queries: np.ndarray) -> np.ndarray:
        """(m,) for shared names (m,): each one's member nearest its query (m, d), all at once.
        Scored in float64, so the nearest is exact and no kernel's rounding decides a near-tie
        (the first member wins an exact one)."""
        sizes = self._start[ids + 1] - self._start[ids]  # (m,) ≥ 2 each
        owner, position = spans(sizes)  # (M,) each
        members = self._members[self._start[ids][owner] + position]  # (M,)
        scores = np.einsum("md,md->m", self.embeddings[members].astype(np.float64),
                           queries[owner].astype(np.float64))  # (M,)
        return members[best_each(sizes, scores)]

    def __contains__(self, text: str) -> bool:
        return name_key(text) in self._ids

    def rows(self, texts: Sequence[str], queries: np.ndarray) -> np.ndarray:
        """(n,) int64: the named item of each text (nearest its query (n, d)), else −1."""
        return self.named_rows(np.array([self.name_id(t) for t in texts], dtype=np.int64),
                               queries)

    def probes(
        self, texts: Sequence[str], queries: np.ndarray,
        encode: Callable[[list[str]], np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray]:
        """(probes (n, d), rows (n,)): named texts are their items, the rest are encoded."""
        rows = self.rows(texts, queries)
        probes = np.zeros((len(texts), self.embeddings.shape[1]), dtype=np.float32)  # (n, d)
        named = rows >= 0
        probes[named] = self.embeddings[rows[named]]
        free = np.flatnonzero(~named)
        if len(free):
            probes[free] = encode([texts[i] for i in free])
        return probes, rows


class PromptNeighbourhood:
    """The items a fan-out prompt names, as catalog rows: each query's n first distinct names,
    the query's own name skipped (`service.fanout.format.context_names`, what the policy's prompt
    lists), each grounded to its item as the teacher's sub-queries are. This is the set the
    teacher chooses its 10 lines from, in its order, so the diffusion student that attends to
    it sees what its teacher saw (`context_source = "prompt"`)."""

    def __init__(self, candidates: Candidates, item_texts: Sequence[str], embeddings: np.ndarray,
                 n: int) -> None:
        self.candidates, self.n = candidates, int(n)
        self.grounding = NameGrounding(item_texts, embeddings)

    def rows(self, texts: Sequence[str], queries: np.ndarray, n: int | None = None
             ) -> np.ndarray:
        """(Q, n) int64 rows for query texts and embeddings (Q, d), best first (n: this
        call's, default the prompt's); when a query's neighbourhood holds fewer than n names,
        its rows repeat in order (fixed shape). `context_names` grounded by
        `NameGrounding.named_rows`, for the whole batch at once."""
        n = n or self.n
        found = self.candidates.rows(texts, queries, 3 * n)  # 3n: room for repeats
        ids = np.full((len(texts), 3 * n), NOT_A_NAME, dtype=np.int64)  # (Q, 3n)
        for i, candidates in enumerate(found):
            ids[i, : len(candidates)] = self.grounding.name_ids[candidates]
        own = np.array([self.grounding.name_id(t) for t in texts], dtype=np.int64)  # (Q,)
        ids[ids == own[:, None]] = NOT_A_NAME  # the query's own name is not offered
        keep = first_occurrences(ids) & (ids != NOT_A_NAME)  # (Q, 3n)
        counts = keep.sum(axis=1)  # (Q,)
        if len(counts) and not counts.all():
            i = int(np.argmin(counts))
            raise ValueError(f"no catalog name near query {i} ({texts[i]!r})")
        kept = np.argsort(~keep, axis=1, kind="stable")  # (Q, 3n) kept positions first, in order
        cycle = np.arange(n)[None, :] % np.minimum(counts, n)[:, None]  # (Q, n)
        names = np.take_along_axis(ids, np.take_along_axis(kept, cycle, axis=1), axis=1)  # (Q, n)
        owners = np.repeat(np.arange(len(texts)), n)  # (Q·n,) each name's query
        return self.grounding.named_rows(names.ravel(), queries, owners).reshape(names.shape)

