"""What the catalog's own text says about a query's candidates: the `ranked` route's inputs.

A broad query's members rarely sit near it in embedding space ("camp" → "campsite"), but their
texts name it, and where they name it says how: WordNet's "tent: a portable shelter ..." is a
kind of shelter because "shelter" is the head of its gloss, and the words around the mention say
more ("any dog of", "not communicable"). Candidates are the hybrid list
(service.fanout.candidates) and the items whose text holds every word of the query, the nearest
`mentions` of them by embedding; each gets one feature row (FEATURES). One definition for the
ranker's training (training/stage1_fanout/ranker.py), its evaluation and the served route.
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
from service.artifacts.lexical import MAX_QUERY_WORDS, WORD, LexicalIndex
from service.fanout.candidates import Candidates
from service.fanout.words import ItemWords

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

    def mentions(self, text: str) -> np.ndarray:
        """The rows of the texts holding every searched word of the query `text`."""
        return self._mentions(self.lexical.token_ids(text))

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
        hybrid list in order: the item side read from `ItemWords` for all rows at once."""
        asked = self.item_words.ids(self.tokens(text))  # (Q,) with repeats, in order
        searched = asked[asked >= 0]  # the ones an item can hold
        position = self._positions(rows, searched)  # (C,) -1: no mention
        names, owner, at = self.item_words.names.gather(rows)  # (T',) each
        name_sizes = self.item_words.names.lengths(rows)  # (C,)
        held = np.bincount(owner[np.isin(names, searched)], minlength=len(rows)) > 0  # (C,)
        last = np.full(len(rows), -1, dtype=np.int64)  # each name's last token
        is_last = at == name_sizes[owner] - 1
        last[owner[is_last]] = names[is_last]
        listed = np.arange(len(rows)) < hybrid
        columns = {
            "similarity": self.embeddings[rows] @ query,
            "hybrid_rank": np.where(listed, np.arange(len(rows)), ABSENT_RANK),
            "mentions": np.isin(rows, self.mentions(text)),
            "mention_position": np.where(position >= 0, position, ABSENT_RANK),
            "early_mention": (position >= 0) & (position < EARLY),
            "log_name_fanin": np.log1p(self.item_words.fanin[rows]),
            "name_words": name_sizes,
            "name_holds_query": held,
            "head_match": (len(asked) > 0) & (last >= 0) & (last == (asked[-1] if len(asked)
                                                                      else -1)),
            "text_words": self.item_words.sizes[rows],
        }
        before, after = self._word_ids(rows, position, len(asked))
        table = np.empty((len(rows), len(FEATURES)), dtype=np.float32)
        for j, column in enumerate([*columns.values(), before, after]):
            table[:, j] = column
        return table

    def _positions(self, rows: np.ndarray, searched: np.ndarray) -> np.ndarray:
        """(C,) the first word of each row's description that is a query word, -1: none."""
        described, owner, at = self.item_words.described.gather(rows)  # (T',) each
        hit = np.flatnonzero(np.isin(described, searched))  # ascending: by row, then position
        position = np.full(len(rows), -1, dtype=np.int64)
        owners, first = np.unique(owner[hit], return_index=True)
        position[owners] = at[hit[first]]
        return position

    def _neighbour_ids(self, rows: np.ndarray, position: np.ndarray, asked: int
                       ) -> tuple[np.ndarray, np.ndarray]:
        """(C,) token ids before and after each row's mention spanning `asked` tokens:
        NONE_ID without a mention, START_ID/END_ID past the description's ends."""
        described = self.item_words.described
        starts, sizes = described.offsets[rows], described.lengths(rows)  # (C,) each
        after = position + asked

        def token(index: np.ndarray, inside: np.ndarray, outside: int) -> np.ndarray:
            at = np.where(inside, starts + index, 0)  # any valid index where unused
            return np.where(inside, described.values[at], outside)

        mentioned = position >= 0
        before = token(position - 1, position > 0, START_ID)
        later = token(after, mentioned & (after < sizes), END_ID)
        return np.where(mentioned, before, NONE_ID), np.where(mentioned, later, NONE_ID)

    def _word_ids(self, rows: np.ndarray, position: np.ndarray, asked: int
                  ) -> tuple[np.ndarray, np.ndarray]:
        """(C,) the ranker's ids (MentionWords) of the words either side of each mention."""
        before, after = self._neighbour_ids(rows, position, asked)
        first, second = self._word_tables
        return first[before + SPECIAL], second[after + SPECIAL]

    @functools.cached_property
    def _word_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(SPECIAL + V,) the ranker's id of every token (and of the three specials), per side."""
        tokens = (NO_MENTION, END, START, *self.item_words.tokens)  # ids -3, -2, -1, 0, ...
        pairs = [self.words.ids(t, t) for t in tokens]
        return (np.array([p[0] for p in pairs], dtype=np.float32),
                np.array([p[1] for p in pairs], dtype=np.float32))

    def neighbours(self, text: str, rows: np.ndarray) -> list[tuple[str, str]]:
        """Per candidate row, the description's words before and after the query's mention."""
        asked = self.item_words.ids(self.tokens(text))
        position = self._positions(rows, asked[asked >= 0])
        tokens = (NO_MENTION, END, START, *self.item_words.tokens)
        return [(tokens[b + SPECIAL], tokens[a + SPECIAL])
                for b, a in zip(*self._neighbour_ids(rows, position, len(asked)), strict=True)]

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


def index_tokens(lexical: LexicalIndex, text: str, limit: int | None = None) -> list[str]:
    """The text's index tokens (of its first `limit` words), in order, repeats kept (the lexical
    index's stemming)."""
    found = WORD.findall(text.lower())[:limit]
    return [t for tokens in lexical.tokenizer.tokens_of(found) for t in tokens]
