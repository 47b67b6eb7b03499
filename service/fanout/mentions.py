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
import math
import threading
from collections.abc import Container, Sequence
from dataclasses import dataclass

import cachetools
import numpy as np
from cachetools import LRUCache

from service.artifacts.bundle import Bundle
from service.artifacts.lexical import MAX_QUERY_WORDS, WORD, LexicalIndex
from service.fanout.candidates import Candidates
from service.fanout.format import item_name

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
MENTION_BYTES = 16 << 20  # the mention lists kept (a batch's, and repeats), by their bytes
ROW_CACHE = 1 << 17  # items whose parts and name fan-in are kept (features are per item)


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
        # per-item caches over functions that do not hold `self`: a cache holding its owner
        # is a reference cycle, which would keep a retired bundle until a full collection
        self.name_fanin = functools.lru_cache(maxsize=ROW_CACHE)(
            functools.partial(name_fanin, self.lexical, self.texts))
        self.parts = functools.lru_cache(maxsize=ROW_CACHE)(
            functools.partial(item_parts, self.lexical, self.texts))
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
        hybrid list in order."""
        asked = self.tokens(text)
        searched = frozenset(asked)  # read per description word of every candidate
        mentioned = np.isin(rows, self.mentions(text))  # (C,)
        similarity = self.embeddings[rows] @ query  # (C,)
        table = np.empty((len(rows), len(FEATURES)), dtype=np.float32)
        for j, row in enumerate(rows.tolist()):
            table[j] = self._row(row, j, asked, searched, bool(mentioned[j]),
                                 float(similarity[j]), j < hybrid)
        return table

    def _row(self, row: int, rank: int, asked: list[str], searched: frozenset[str],
             mentions: bool, similarity: float, listed: bool) -> list[float]:
        name, described, size = self.parts(row)
        position = mention_position(described, searched)
        return [similarity, rank if listed else ABSENT_RANK, float(mentions),
                ABSENT_RANK if position is None else position,
                float(position is not None and position < EARLY),
                math.log1p(self.name_fanin(row)), len(name), float(bool(searched & set(name))),
                float(bool(name) and bool(asked) and name[-1] == asked[-1]), size,
                *self.words.ids(*neighbours(described, asked, position))]

    def neighbours(self, text: str, rows: np.ndarray) -> list[tuple[str, str]]:
        """Per candidate row, the description's words before and after the query's mention."""
        asked = self.tokens(text)
        searched = frozenset(asked)
        out = []
        for row in rows.tolist():
            described = self.parts(row)[1]
            out.append(neighbours(described, asked, mention_position(described, searched)))
        return out

    def tokens(self, text: str) -> list[str]:
        """The query's index tokens, of its first MAX_QUERY_WORDS words."""
        return index_tokens(self.lexical, text, MAX_QUERY_WORDS)

    def with_words(self, words: MentionWords) -> MentionFeatures:
        """These candidates and per-item caches, the mention's words read as `words`' ids: a
        ranker learns its words from the rows of the features it then computes with them."""
        shared = copy.copy(self)
        shared.words = words
        return shared


def mention_position(described: tuple[str, ...], searched: Container[str]) -> int | None:
    """The first word of a description that is a query word, or None."""
    return next((i for i, t in enumerate(described) if t in searched), None)


def neighbours(described: tuple[str, ...], asked: list[str], position: int | None
               ) -> tuple[str, str]:
    """The words before and after a mention at `position` spanning the query's length."""
    if position is None:
        return NO_MENTION, NO_MENTION
    after = position + len(asked)
    return (described[position - 1] if position else START,
            described[after] if after < len(described) else END)


def index_tokens(lexical: LexicalIndex, text: str, limit: int | None = None) -> list[str]:
    """The text's index tokens (of its first `limit` words), in order, repeats kept (the lexical
    index's stemming)."""
    found = WORD.findall(text.lower())[:limit]
    return [t for tokens in lexical.tokenizer.tokens_of(found) for t in tokens]


def item_parts(lexical: LexicalIndex, texts: Sequence[str], row: int
               ) -> tuple[tuple[str, ...], tuple[str, ...], int]:
    """An item's name tokens, its description's tokens (after the first colon, else the
    whole text) and its text's token count: per item, not per query."""
    text = texts[row]
    _, colon, gloss = text.partition(":")
    described = index_tokens(lexical, gloss if colon else text)
    return (tuple(index_tokens(lexical, item_name(text))), tuple(described),
            len(index_tokens(lexical, text)))


def name_fanin(lexical: LexicalIndex, texts: Sequence[str], row: int) -> int:
    """Texts holding the item's name: how category-like it is."""
    return lexical.breadth(item_name(texts[row]))
