"""What a standalone diffusion student reads of each of its context items besides the item's
embedding: the ranker's mention features (service.ranker.mentions), computed in numpy from the
item side compiled once per bundle (service.ranker.words), in a fixed numeric encoding. The
ranker's knowledge is where the query's words sit in an item's text; these columns carry it to
the student, which then needs neither the ranker's model nor its candidate lists to serve."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import cachetools
import numpy as np
from cachetools import LRUCache

from service.artifacts.bundle import Bundle
from service.ranker.mentions import ABSENT_RANK, FEATURES, MentionFeatures, MentionWords
from service.runtime.index import neighbour_rows

WORDS = 30  # words per side told apart (the ranker's default); one more slot for any other
NUMERIC = ("similarity", "mentions", "mention_position", "early_mention", "log_name_fanin",
           "name_words", "name_holds_query", "head_match", "text_words", "rank")
MENTION_WIDTH = len(NUMERIC) + 2 * (WORDS + 1)  # as a student trains on them: words one-hot
COMPACT_WIDTH = len(NUMERIC) + 2  # as a served sampler reads them: each side's word id
BLOCK_BYTES = 64 << 20  # the mention blocks kept (a batch's, and repeats), by their bytes


def leading_mentions(n: int) -> int:
    """How many of a "mentioned" context's n items are the query's nearest mentions (two
    thirds; its nearest items fill the rest): the ranker's picks come from there and the
    hybrid list, which the dense neighbourhood alone misses."""
    return 2 * n // 3


def mention_columns(table: np.ndarray, context: int) -> np.ndarray:
    """(N, COMPACT_WIDTH) float32 for feature rows (N, F) of queries' `context` nearest items
    in order: the NUMERIC columns (counts on a log scale), then each side's word id (0..WORDS,
    WORDS for any other word), as a served sampler reads them (its graph looks the ids up)."""
    column = {name: table[:, i] for i, name in enumerate(FEATURES)}
    rank = np.tile(np.arange(context, dtype=np.float32) / context, len(table) // context)
    numeric = [column["similarity"], column["mentions"],
               np.log1p(column["mention_position"]) / np.log1p(ABSENT_RANK),
               column["early_mention"], column["log_name_fanin"] / 5,
               column["name_words"] / 5, column["name_holds_query"], column["head_match"],
               np.log1p(column["text_words"]) / 4, rank]
    out = np.empty((len(table), COMPACT_WIDTH), dtype=np.float32)
    for j, values in enumerate(numeric):
        out[:, j] = values
    for side, name in enumerate(("word_before_mention", "word_after_mention")):
        out[:, len(NUMERIC) + side] = np.minimum(column[name], WORDS)
    return out


def one_hot(columns: np.ndarray) -> np.ndarray:
    """(..., MENTION_WIDTH) the model's encoding of compact columns (..., COMPACT_WIDTH): the
    numeric ones, then each side's word one-hot (what a student trains on)."""
    flat = columns.reshape(-1, COMPACT_WIDTH)
    out = np.zeros((len(flat), MENTION_WIDTH), dtype=np.float32)
    out[:, : len(NUMERIC)] = flat[:, : len(NUMERIC)]
    everyone = np.arange(len(flat))
    for side in range(2):
        word = flat[:, len(NUMERIC) + side].astype(np.int64)
        out[everyone, len(NUMERIC) + side * (WORDS + 1) + word] = 1.0
    return out.reshape(*columns.shape[:-1], MENTION_WIDTH)


def encode_mentions(table: np.ndarray, context: int) -> np.ndarray:
    """(N, MENTION_WIDTH) float32: `mention_columns` with each side's word one-hot."""
    return one_hot(mention_columns(table, context))


class MentionContext:
    """The compact mention columns (B, C, COMPACT_WIDTH) of each query's context rows (B, C)."""

    def __init__(self, bundle: Bundle, words: MentionWords,
                 shared: MentionFeatures | None = None) -> None:
        """`shared`: the bundle's ranker's features, whose per-item caches these reuse."""
        if len(words.before) > WORDS or len(words.after) > WORDS:
            raise ValueError(f"a student tells apart at most {WORDS} words per side")
        self.features = MentionFeatures(bundle, words=words) if shared is None \
            else shared.with_words(words)

    def __call__(self, texts: Sequence[str], queries: np.ndarray, rows: np.ndarray,
                 context: np.ndarray | None = None) -> np.ndarray:
        """`context`: the rows' embeddings (B, C, d), when the caller gathered them."""
        similarity = None if context is None else (context @ queries[:, :, None]).reshape(-1)
        table = self.features.table(texts, queries, [(r, 0) for r in rows], similarity)
        return mention_columns(table, rows.shape[1]).reshape(*rows.shape, COMPACT_WIDTH)


class MentionedNeighbourhood:
    """A standalone student's context (context_source "mentioned"): the query's nearest
    `leading_mentions(n)` items whose text holds its every word, nearest first, then its
    nearest items, n in all; a lookup in the lexical index's postings and one ANN search, no
    ranker."""

    def __init__(self, features: MentionFeatures, index: Any, n: int) -> None:
        self.features, self.index, self.n = features, index, int(n)
        self.lead = leading_mentions(self.n)
        # a query's mentions with their embeddings side by side: one contiguous product a
        # query, not a gather from the catalog (bounded by bytes, as the mention lists are)
        # (a plain function: a bound method would make a cycle the served state must not hold)
        self._blocks = cachetools.cached(
            LRUCache(BLOCK_BYTES, getsizeof=lambda block: block[0].nbytes + block[1].nbytes),
            lock=threading.Lock(), key=lambda ids: tuple(sorted(set(ids))))(
            functools.partial(mention_block, features.holding, features.embeddings))

    def leading(self, texts: Sequence[str], queries: np.ndarray) -> np.ndarray:
        """(Q, lead) int64: each query's nearest mentions, nearest first, -1 past its last."""
        out = np.full((len(texts), self.lead), -1, dtype=np.int64)
        for i, (text, query) in enumerate(zip(texts, queries, strict=True)):
            held, vectors = self._blocks(self.features.lexical.token_ids(text))
            similarity = vectors @ query  # (M,)
            if len(held) > self.lead:  # the nearest of a broad word's thousands
                kept = np.argpartition(-similarity, self.lead)[: self.lead]
                held, similarity = held[kept], similarity[kept]
            out[i, : len(held)] = held[np.argsort(-similarity, kind="stable")]
        return out

    def rows(self, texts: Sequence[str], queries: np.ndarray) -> np.ndarray:
        """(Q, n) int64 catalog rows of each query (texts and embeddings (Q, d))."""
        nearest = neighbour_rows(self.index, queries, self.n)  # (Q, n)
        lead = self.leading(texts, queries)  # (Q, lead)
        repeated = (nearest[:, :, None] == lead[:, None, :]).any(axis=2)  # (Q, n) led already
        kept = np.concatenate([lead >= 0, ~repeated], axis=1)  # (Q, lead + n)
        order = np.argsort(~kept, axis=1, kind="stable")[:, : self.n]  # kept first, in order
        return np.take_along_axis(np.concatenate([lead, nearest], axis=1), order, axis=1)


def mention_block(holding: Callable[[list[int]], np.ndarray], embeddings: np.ndarray,
                  ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The rows (M,) of the texts holding every token of `ids` (the mention features' own
    lookup, so a cold query's postings are intersected once), and their embeddings (M, d)."""
    rows = holding(ids)
    return rows, np.ascontiguousarray(embeddings[rows])
