"""Sub-query grounding: a sub-query that is exactly a catalog item's name stands for that item.

The fan-out LM writes item names (service/fanout/trie.py keeps its lines to them). Embedding a bare
name loses the item it came from: a first lemma's text vector finds its own item first for only
49% of WordNet nouns (cosine 0.67 to it), since names are short and shared. So a sub-query equal
to a name (case and spacing aside) is resolved by lookup, like an id: its probe is that item's
embedding — among items sharing the name, the one nearest the query. Any other text is embedded
and searched as before. Serving, the reward, synthesis and evaluation all resolve through here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from service.fanout.candidates import Candidates
from service.fanout.format import item_name

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
        self._rows = {key: np.asarray(rows, dtype=np.int64) for key, rows in rows_of.items()}
        # the same map as arrays, for batches of rows: each row's name id (−1: no name) and
        # each name's only row (−1: shared by several, chosen per query)
        self._ids = {key: i for i, key in enumerate(self._rows)}
        self.name_ids = np.full(len(item_texts), NOT_A_NAME, dtype=np.int64)  # (N,)
        self._only = np.full(len(self._rows), NOT_A_NAME, dtype=np.int64)  # (K,)
        for i, rows in enumerate(self._rows.values()):
            self.name_ids[rows] = i
            if len(rows) == 1:
                self._only[i] = rows[0]
        self._shared = list(self._rows.values())  # name id → its rows

    def name_id(self, text: str) -> int:
        """The id of the name `text` is (case and spacing aside), else −1."""
        return self._ids.get(name_key(text), NOT_A_NAME)

    def named_rows(self, ids: np.ndarray, query: np.ndarray) -> np.ndarray:
        """(n,) the item of each name id (n,) for one query (d,): `rows` without the texts
        (a shared name's product taken per name, as there, so near-ties break alike)."""
        rows = self._only[ids]  # (n,)
        for j in np.flatnonzero(rows < 0).tolist():
            shared = self._shared[int(ids[j])]
            rows[j] = shared[np.argmax(self.embeddings[shared] @ query)]
        return rows

    def __contains__(self, text: str) -> bool:
        return name_key(text) in self._rows

    def rows(self, texts: Sequence[str], queries: np.ndarray) -> np.ndarray:
        """(n,) int64: the named item of each text (nearest its query (n, d)), else −1."""
        out = np.full(len(texts), NOT_A_NAME, dtype=np.int64)
        for i, text in enumerate(texts):
            rows = self._rows.get(name_key(text))
            if rows is not None:
                out[i] = rows[0] if len(rows) == 1 else rows[np.argmax(self.embeddings[rows]
                                                                       @ queries[i])]
        return out

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

    def rows(self, texts: Sequence[str], queries: np.ndarray) -> np.ndarray:
        """(Q, n) int64 rows for query texts and embeddings (Q, d), best first; when a query's
        neighbourhood holds fewer than n names, its rows repeat in order (fixed shape).
        `context_names` grounded by `NameGrounding.rows`, computed on name ids: the items'
        names are compared once, when the grounding is built, not per query."""
        out = np.empty((len(texts), self.n), dtype=np.int64)
        found = self.candidates.rows(texts, queries, 3 * self.n)  # 3n: room for repeats
        for i, (text, candidates) in enumerate(zip(texts, found, strict=True)):
            ids = self.grounding.name_ids[candidates]  # (m,) name of each candidate
            ids = ids[(ids != NOT_A_NAME) & (ids != self.grounding.name_id(text))]
            _, first = np.unique(ids, return_index=True)
            ids = ids[np.sort(first)][: self.n]  # the first n distinct names, in order
            if not len(ids):
                raise ValueError(f"no catalog name near query {i} ({texts[i]!r})")
            out[i] = np.resize(self.grounding.named_rows(ids, queries[i]), self.n)  # (n,)
        return out
