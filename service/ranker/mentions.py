"""What the catalog's own text says about a query's candidates: the `ranked` route's inputs.

A broad query's members rarely sit near it in embedding space, but their texts name it, and
where ("tent: a portable *shelter*") and beside what ("any *dog* of") says how. Candidates are
the hybrid list and the nearest items whose text holds every query word; each gets a row of
FEATURES, one definition for the ranker's training, its evaluation and the served route.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import cachetools
import numpy as np
from cachetools import LRUCache

from service.artifacts.bundle import Bundle
from service.artifacts.lexical import MAX_QUERY_WORDS, QUERY_IDS_CACHED, WORD, LexicalIndex
from service.fanout.candidates import Candidates
from service.ranker.words import ItemWords

FEATURES = (
    "similarity",  # cos(query, item)
    "hybrid_rank",  # rank in the hybrid list (ABSENT_RANK when not in it)
    "mentions",  # 1 when the item's text holds every word of the query
    "mention_position",  # first word of the description naming the query (ABSENT_RANK: none)
    "early_mention",  # 1 when that word is among the description's first EARLY words
    "log_name_fanin",  # ln(1 + texts holding the item's name): how category-like it is
    "name_words",  # words in the item's name
    "name_holds_query",  # 1 when the item's name shares a word with the query
    "head_match",  # 1 when the item's name ends with the query's last word
    "text_words",  # words in the item's text
    # the description's words either side of the mention ("any *dog* of", "not *communicable*"),
    # as ids in the vocabulary the ranker learned (MentionWords): categorical
    "word_before_mention",
    "word_after_mention",
)
CATEGORICAL = ("word_before_mention", "word_after_mention")
NO_MENTION, START, END = "<none>", "<start>", "<end>"  # the neighbours of no, a first, a last word
ABSENT_RANK = 99.0
EARLY = 3  # "a portable shelter": the genus sits in a gloss's first words
# ItemWords' ids of the specials, before its vocabulary (offset by SPECIAL in the word tables)
NONE_ID, END_ID, START_ID, SPECIAL = -3, -2, -1, 3
SPECIALS = (NO_MENTION, END, START)  # the words of ids -3, -2, -1
NO_TOKEN = np.iinfo(np.int64).min  # the last token of an empty query: equal to none
MENTION_BYTES = 16 << 20  # the mention lists kept (a batch's, and repeats), by their bytes


@dataclass(frozen=True)
class MentionWords:
    """The words either side of a mention the ranker tells apart, most frequent first; any other
    word is one id past the list's end."""

    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()

    @functools.cached_property
    def _index(self) -> tuple[dict[str, int], dict[str, int]]:
        """word → id on each side, built once: ids are read for every candidate row."""
        return ({w: i for i, w in enumerate(self.before)},
                {w: i for i, w in enumerate(self.after)})

    def ids(self, before: str, after: str) -> tuple[float, float]:
        first, second = self._index
        return (float(first.get(before, len(self.before))),
                float(second.get(after, len(self.after))))


@dataclass(frozen=True)
class CandidateSizes:
    """How many candidates each source gives a query."""

    hybrid: int = 50
    mentions: int = 300


@dataclass(frozen=True)
class CandidateBatch:
    """A batch's candidate lists end to end: each row's catalog row, query, rank in its list
    and whether it came from the query's hybrid list."""

    rows: np.ndarray  # (N,) int64
    owner: np.ndarray  # (N,) int64 index of its query
    rank: np.ndarray  # (N,) int64
    listed: np.ndarray  # (N,) bool

    @classmethod
    def of(cls, found: Sequence[tuple[np.ndarray, int]]) -> CandidateBatch:
        sizes = np.array([len(rows) for rows, _ in found], dtype=np.int64)
        owner = np.repeat(np.arange(len(found)), sizes)
        rank = np.arange(int(sizes.sum())) - np.concatenate([[0], np.cumsum(sizes)[:-1]])[owner]
        hybrid = np.array([listed for _, listed in found], dtype=np.int64)
        rows = np.concatenate([rows for rows, _ in found] or [np.zeros(0, dtype=np.int64)])
        return cls(rows.astype(np.int64), owner, rank, rank < hybrid[owner])


@dataclass(frozen=True)
class AskedTokens:
    """A batch's queries' tokens as ItemWords ids: their count, last id and the ones an item
    can hold (Q, W), padded with NO_TOKEN."""

    sizes: np.ndarray  # (Q,) tokens per query, repeats kept
    last: np.ndarray  # (Q,) each query's last token, NO_TOKEN for an empty query
    searched: np.ndarray  # (Q, W) int64

    @classmethod
    def of(cls, ids: Sequence[np.ndarray]) -> AskedTokens:
        return cls.of_held([(a, np.unique(a[a >= 0])) for a in ids])

    @classmethod
    def of_held(cls, queries: Sequence[tuple[np.ndarray, np.ndarray]]) -> AskedTokens:
        """From each query's token ids and the distinct ones an item can hold (`held`)."""
        ids, held = [a for a, _ in queries], [h for _, h in queries]
        sizes = np.array([len(a) for a in ids], dtype=np.int64)
        last = np.array([a[-1] if len(a) else NO_TOKEN for a in ids], dtype=np.int64)
        searched = np.full((len(ids), max([len(h) for h in held], default=0)), NO_TOKEN)
        for q, h in enumerate(held):
            searched[q, : len(h)] = h
        return cls(sizes, last, searched)

    def holds(self, owner: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """(T,) whether each item token (T,) is a token of its query `owner` (T,): one
        comparison per query word, a batch's longest query's count (a few, not a sort)."""
        found = np.zeros(len(tokens), dtype=bool)
        for column in self.searched.T:  # (Q,)
            found |= tokens == column[owner]
        return found


def sorted_holds(keys: np.ndarray, probes: np.ndarray) -> np.ndarray:
    """(P,) whether each probe is among the ascending `keys`: a binary search, not a sort."""
    at = np.minimum(np.searchsorted(keys, probes), max(len(keys) - 1, 0))
    return keys[at] == probes if len(keys) else np.zeros(len(probes), dtype=bool)


class MentionFeatures:
    """A query's candidate rows and their feature rows (C, len(FEATURES))."""

    def __init__(self, bundle: Bundle, sizes: CandidateSizes = CandidateSizes(),
                 words: MentionWords = MentionWords()) -> None:
        if bundle.lexical is None:
            raise ValueError("mention features need the bundle's lexical index")
        self.lexical: LexicalIndex = bundle.lexical
        self.hybrid = Candidates.of(bundle, "hybrid")
        self.texts, self.embeddings, self.sizes = bundle.items.texts, bundle.items.embeddings, sizes
        self.words = words
        self.item_words = ItemWords.of(bundle)
        # a query's mentions, read once for its candidates and once for its features; keyed
        # on its searched tokens ("Dogs!" is "dog"), bounded by bytes (a broad word's are long)
        self._mentions = cachetools.cached(
            LRUCache(MENTION_BYTES, getsizeof=lambda rows: rows.nbytes), lock=threading.Lock(),
            key=lambda ids: tuple(sorted(set(ids))))(self.lexical.holding)
        # a query's tokens by its text, worked out once (a batch repeats popular queries)
        # (a plain function: a bound method would make a cycle the served state must not hold)
        self._query_tokens = cachetools.cached(LRUCache(QUERY_IDS_CACHED), lock=threading.Lock())(
            functools.partial(held_tokens, self.item_words, self.lexical))

    def mentions(self, text: str) -> np.ndarray:
        """The rows of the texts holding every searched word of the query `text`."""
        return self.holding(self.lexical.token_ids(text))

    def holding(self, ids: list[int]) -> np.ndarray:
        """The rows of the texts holding every token of `ids`, looked up once per token set."""
        return self._mentions(ids)

    def candidates(self, texts: Sequence[str],
                   queries: np.ndarray) -> list[tuple[np.ndarray, int]]:
        """Per query (texts, embeddings (Q, d)): distinct catalog rows, the hybrid list first,
        then the mentions nearest the query that it lacks; and the hybrid list's length."""
        hybrid = self.hybrid.rows(texts, queries, self.sizes.hybrid)
        out = []
        for text, query, listed in zip(texts, queries, hybrid, strict=True):
            mentions = self.mentions(text)
            if len(mentions) > self.sizes.mentions:  # the nearest of a broad word's thousands
                near = np.argpartition(-(self.embeddings[mentions] @ query), self.sizes.mentions)
                mentions = np.sort(mentions[near[: self.sizes.mentions]])
            rows = dict.fromkeys([*listed.tolist(), *mentions.tolist()])
            out.append((np.array(list(rows), dtype=np.int64), len(listed)))
        return out

    def features(self, text: str, query: np.ndarray, rows: np.ndarray,
                 hybrid: int) -> np.ndarray:
        """(C, F) float32 for one query's candidate rows, the first `hybrid` of them its
        hybrid list in order."""
        return self.table([text], query[None], [(rows, hybrid)])

    def table(self, texts: Sequence[str], queries: np.ndarray,
              found: Sequence[tuple[np.ndarray, int]],
              similarity: np.ndarray | None = None) -> np.ndarray:
        """(ΣC, F) float32: the feature rows of a batch's candidates (`candidates`' output for
        texts and embeddings (Q, d)), query after query, read for the whole batch at once;
        `similarity` (ΣC,): their cosines, when the caller holds their embeddings already."""
        batch = CandidateBatch.of(found)
        rows, owner = batch.rows, batch.owner
        asked = self._asked(texts)
        position = self._positions(batch, asked)  # (N,) -1: no mention
        names, name_of, at = self.item_words.names.gather(rows)  # (T',) each
        name_sizes = self.item_words.names.lengths(rows)  # (N,)
        held = asked.holds(owner[name_of], names)  # (T',)
        last = np.full(len(rows), NONE_ID, dtype=np.int64)  # each name's last token
        is_last = at == name_sizes[name_of] - 1
        last[name_of[is_last]] = names[is_last]
        mentioned = [self.mentions(text) for text in texts]
        columns = {
            "similarity": similarity if similarity is not None else np.concatenate(
                [self.embeddings[r] @ q for (r, _), q in zip(found, queries, strict=True)] or [[]]),
            "hybrid_rank": np.where(batch.listed, batch.rank, ABSENT_RANK),
            "mentions": sorted_holds(np.concatenate(  # ascending: queries', then rows
                [q * len(self.texts) + m for q, m in enumerate(mentioned)] or [[]]),
                owner * len(self.texts) + rows),
            "mention_position": np.where(position >= 0, position, ABSENT_RANK),
            "early_mention": (position >= 0) & (position < EARLY),
            "log_name_fanin": np.log1p(self.item_words.fanin[rows]),
            "name_words": name_sizes,
            "name_holds_query": np.bincount(name_of[held], minlength=len(rows)) > 0,
            "head_match": (last >= 0) & (last == asked.last[owner]),
            "text_words": self.item_words.sizes[rows],
        }
        before, after = self._word_ids(batch, position, asked)
        table = np.empty((len(rows), len(FEATURES)), dtype=np.float32)
        for j, column in enumerate([*columns.values(), before, after]):
            table[:, j] = column
        return table

    def _asked(self, texts: Sequence[str]) -> AskedTokens:
        return AskedTokens.of_held([self._query_tokens(t) for t in texts])

    def _positions(self, batch: CandidateBatch, asked: AskedTokens) -> np.ndarray:
        """(N,) the first word of each row's description that is a word of its query, -1:
        none."""
        described, row_of, at = self.item_words.described.gather(batch.rows)  # (T',) each
        hit = np.flatnonzero(asked.holds(batch.owner[row_of], described))  # by row, position
        position = np.full(len(batch.rows), -1, dtype=np.int64)
        hit_rows = row_of[hit]  # ascending
        first = np.flatnonzero(np.r_[True, hit_rows[1:] != hit_rows[:-1]]) if len(hit) else hit
        position[hit_rows[first]] = at[hit[first]]
        return position

    def _neighbour_ids(self, batch: CandidateBatch, position: np.ndarray, asked: AskedTokens
                       ) -> tuple[np.ndarray, np.ndarray]:
        """(N,) token ids before and after each row's mention spanning its query's tokens:
        NONE_ID without a mention, START_ID/END_ID past the description's ends."""
        described = self.item_words.described
        starts, sizes = described.offsets[batch.rows], described.lengths(batch.rows)  # (N,)
        after = position + asked.sizes[batch.owner]

        def token(index: np.ndarray, inside: np.ndarray, outside: int) -> np.ndarray:
            at = np.where(inside, starts + index, 0)  # any valid index where unused
            return np.where(inside, described.values[at], outside)

        mentioned = position >= 0
        before = token(position - 1, position > 0, START_ID)
        later = token(after, mentioned & (after < sizes), END_ID)
        return np.where(mentioned, before, NONE_ID), np.where(mentioned, later, NONE_ID)

    def _word_ids(self, batch: CandidateBatch, position: np.ndarray, asked: AskedTokens
                  ) -> tuple[np.ndarray, np.ndarray]:
        """(N,) the ranker's ids (MentionWords) of the words either side of each mention."""
        before, after = self._neighbour_ids(batch, position, asked)
        first, second = self._word_tables
        return first[before + SPECIAL], second[after + SPECIAL]

    @functools.cached_property
    def _word_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(SPECIAL + V,) the ranker's id of every token (and of the three specials), per side."""
        tokens = (*SPECIALS, *self.item_words.tokens)  # ids -3, -2, -1, 0, ...
        pairs = [self.words.ids(t, t) for t in tokens]
        return (np.array([p[0] for p in pairs], dtype=np.float32),
                np.array([p[1] for p in pairs], dtype=np.float32))

    def neighbours(self, text: str, rows: np.ndarray) -> list[tuple[str, str]]:
        """Per candidate row, the description's words before and after the query's mention."""
        batch, asked = CandidateBatch.of([(rows, 0)]), self._asked([text])
        position = self._positions(batch, asked)
        tokens = (*SPECIALS, *self.item_words.tokens)
        return [(tokens[b + SPECIAL], tokens[a + SPECIAL])
                for b, a in zip(*self._neighbour_ids(batch, position, asked), strict=True)]

    def tokens(self, text: str) -> list[str]:
        """The query's index tokens, of its first MAX_QUERY_WORDS words."""
        return index_tokens(self.lexical, text, MAX_QUERY_WORDS)

    def with_words(self, words: MentionWords) -> MentionFeatures:
        """These candidates and per-item caches, the mention's words read as `words`' ids: a
        ranker learns its words from the rows of the features it then computes with them."""
        shared = copy.copy(self)
        shared.words = words
        shared.__dict__.pop("_word_tables", None)  # the old words' ids
        return shared


def held_tokens(item_words: ItemWords, lexical: LexicalIndex, text: str
                ) -> tuple[np.ndarray, np.ndarray]:
    """The query's tokens as ItemWords ids, and the distinct ones an item can hold."""
    ids = item_words.ids(index_tokens(lexical, text, MAX_QUERY_WORDS))
    return ids, np.unique(ids[ids >= 0])


def index_tokens(lexical: LexicalIndex, text: str, limit: int | None = None) -> list[str]:
    """The text's index tokens (of its first `limit` words), in order, repeats kept (the lexical
    index's stemming)."""
    found = WORD.findall(text.lower())[:limit]
    return [t for tokens in lexical.tokenizer.tokens_of(found) for t in tokens]
