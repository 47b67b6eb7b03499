"""The AR route's expansion cache: fan-outs kept per normalised query, least recently used
evicted, so a repeated query (the head of real traffic) skips the fan-out model."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from cachetools import LRUCache

from service.fanout.format import Generation


def cache_key(query: str) -> str:
    """Case and whitespace folded: "Camping  Gear" and "camping gear" share one fan-out."""
    return " ".join(query.casefold().split())


class FanoutCache:
    """A bounded LRU map from normalised query to its fan-out; size 0 keeps nothing."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: LRUCache[str, Generation] | None = LRUCache(size) if size > 0 else None
        self._lock = threading.Lock()  # cachetools' caches are not thread-safe

    def __len__(self) -> int:
        return len(self._entries) if self._entries is not None else 0

    def get_many(self, queries: Sequence[str]) -> list[Generation | None]:
        if self._entries is None:
            return [None] * len(queries)
        with self._lock:
            return [self._entries.get(cache_key(q)) for q in queries]

    def put_many(self, queries: Sequence[str], generations: Sequence[Generation]) -> None:
        if self._entries is None:
            return
        with self._lock:
            for query, generation in zip(queries, generations, strict=True):
                self._entries[cache_key(query)] = generation
