"""Sub-query resolution: each sampled sub-query text to its catalog item and probe, the
target block the denoiser learns, with each distinct text embedded and searched once per run."""

from __future__ import annotations

from typing import Any

import numpy as np

from service.fanout.format import parse_fanout
from service.fanout.grounding import NameGrounding
from service.runtime.encoder import Encoder
from service.runtime.index import search
from training.stage1_fanout.reward import reward_terms


class ResolutionCache:
    """Sub-query text → (probe, top-1 row, cosine), shared across queries of a run.

    A catalog name resolves to its item by lookup (service/fanout/grounding.py: probe = the item,
    cosine
    1); other texts are embedded and searched once each — a trained policy reuses texts across
    queries. Bounded: cleared when it holds `limit` texts.
    """

    def __init__(self, bundle: Any, encoder: Encoder, limit: int = 500_000) -> None:
        self.bundle, self.encoder, self.limit = bundle, encoder, limit
        self.grounding = NameGrounding(bundle.items.texts, bundle.items.embeddings)
        self.entries: dict[str, tuple[np.ndarray, int, float]] = {}
        self.searches = 0

    def lookup(
        self, texts: list[str], query: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(probes (U, d), rows (U,), sims (U,)) of distinct `texts` written for `query` (d,)."""
        named = self.grounding.rows(texts, np.broadcast_to(query, (len(texts), len(query))))
        free = [t for t, r in zip(texts, named, strict=True) if r < 0]
        missing = [t for t in free if t not in self.entries]
        if len(self.entries) + len(missing) > self.limit:
            self.entries.clear()
            missing = free
        if missing:
            vectors = self.encoder.encode(missing)  # (M, d)
            sims, rows = search(self.bundle.index, vectors, 1)  # (M, 1)
            self.searches += len(missing)
            for j, text in enumerate(missing):
                self.entries[text] = (vectors[j], int(rows[j, 0]), float(sims[j, 0]))
        items = self.bundle.items.embeddings
        got = [(items[r], int(r), 1.0) if r >= 0 else self.entries[t]
               for t, r in zip(texts, named, strict=True)]
        return (np.stack([g[0] for g in got]), np.array([g[1] for g in got], dtype=np.int64),
                np.array([g[2] for g in got], dtype=np.float32))


def resolve_samples(
    cache: ResolutionCache, query_emb: np.ndarray, texts: list[str], k: int
) -> dict[str, Any] | None:
    """Embed and resolve one query's samples; drops samples with an empty slot."""
    parsed = [parse_fanout(t, k) for t in texts]
    keep = [i for i, p in enumerate(parsed) if all(p.subqueries)]
    if not keep:
        return None
    subs = [s for i in keep for s in parsed[i].subqueries]
    position = {text: j for j, text in enumerate(dict.fromkeys(subs))}
    slot = np.array([position[s] for s in subs])  # (S·k,) into the distinct texts
    vectors, rows, sims = cache.lookup(list(position), query_emb)  # (U, d), (U,), (U,)
    probes = vectors[slot].reshape(len(keep), k, -1)  # (S, k, d)
    rows = rows[slot].reshape(len(keep), k)  # (S, k)
    target = cache.bundle.items.embeddings[rows]  # (S, k, d)
    valid = np.stack([parsed[i].scored for i in keep])  # (S, k): the GRPO reward's slots
    terms = reward_terms(query_emb, probes, valid, sims[slot].reshape(len(keep), k), target)
    return {"keep": np.asarray(keep), "rows": rows, "target": target, "terms": terms,
            "subs": [parsed[i].subqueries for i in keep]}
