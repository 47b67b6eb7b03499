"""Each catalog item's words as the lexical index's tokens, compiled once per catalog: the item
side of the ranker's mention features (service.ranker.mentions), so a batch's candidates are
read in a few numpy operations instead of a Python loop over their rows and a tokenizer call
for every item never seen before.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.artifacts.bundle import Bundle
from service.artifacts.lexical import WORD, FtsTokenizer, LexicalIndex, query_words
from service.fanout.format import item_name

_BUILDING = threading.Lock()  # one build per bundle, whichever reader asks first


@dataclass(frozen=True)
class Ragged:
    """Rows of different lengths in one flat array: row i is values[offsets[i]:offsets[i+1]]."""

    offsets: np.ndarray  # (M + 1,) int64
    values: np.ndarray  # (T,) int32

    @classmethod
    def of(cls, rows: Sequence[Sequence[int]]) -> Ragged:
        lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        values = np.fromiter((v for r in rows for v in r), np.int32, int(offsets[-1]))
        return cls(offsets, values)

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        """(C,) the lengths of `rows`."""
        return self.offsets[rows + 1] - self.offsets[rows]

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The values of `rows` (C,) end to end (T',), and each value's row (its index in
        `rows`) and position within that row, both (T',)."""
        starts, lengths = self.offsets[rows], self.lengths(rows)
        owner = np.repeat(np.arange(len(rows)), lengths)  # (T',)
        first = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # (C,) each row's start in T'
        position = np.arange(int(lengths.sum())) - first[owner]  # (T',)
        return self.values[starts[owner] + position], owner, position


@dataclass(frozen=True)
class ItemWords:
    """Per item: its name's tokens, its description's tokens (after the first colon, else the
    whole text), its text's token count and how many texts hold its name (how category-like
    it is); tokens as ids in `tokens` (the lexical index's vocabulary, then any it lacks)."""

    tokens: tuple[str, ...]
    names: Ragged
    described: Ragged
    sizes: np.ndarray  # (M,) int64
    fanin: np.ndarray  # (M,) int64

    @classmethod
    def of(cls, bundle: Bundle) -> ItemWords:
        """The bundle's, built on first use (a few seconds for 80,000 items) and kept with it."""
        if bundle.lexical is None:
            raise ValueError("item words need the bundle's lexical index")
        with _BUILDING:
            words = bundle.derived.get("words")
            if words is None:
                words = bundle.derived["words"] = cls.build(bundle.lexical, bundle.items.texts)
        return words

    @classmethod
    def build(cls, lexical: LexicalIndex, texts: Sequence[str]) -> ItemWords:
        """Tokenize the catalog's distinct words in one pass, then each text from them."""
        found = [WORD.findall(text.lower()) for text in texts]
        distinct = list(dict.fromkeys(w for words in found for w in words))
        tokenizer = FtsTokenizer(cache_size=len(distinct) + 1)
        try:
            stems = dict(zip(distinct, tokenizer.tokens_of(distinct), strict=True))
        finally:
            tokenizer.close()
        vocab = dict(lexical.vocab)

        def ids(words: Sequence[str]) -> list[int]:
            return [vocab.setdefault(t, len(vocab)) for w in words for t in stems[w]]

        names, described, sizes = [], [], []
        for text, words in zip(texts, found, strict=True):
            name = item_name(text)
            _, colon, gloss = text.partition(":")
            names.append(ids(WORD.findall(name.lower())))
            described.append(ids(WORD.findall(gloss.lower()) if colon else words))
            sizes.append(sum(len(stems[w]) for w in words))
        fanin = [len(lexical.holding([lexical.vocab[t] for w in query_words(name, lexical.frequent)
                                      for t in stems[w] if t in lexical.vocab]))
                 for name in map(item_name, texts)]  # LexicalIndex.breadth, tokenized here
        tokens = tuple(sorted(vocab, key=vocab.__getitem__))
        return cls(tokens, Ragged.of(names), Ragged.of(described),
                   np.array(sizes, dtype=np.int64), np.array(fanin, dtype=np.int64))

    def ids(self, tokens: Sequence[str]) -> np.ndarray:
        """(Q,) int64 ids of a query's tokens; one no item holds is negative (each its own)."""
        index = self._index
        return np.array([index.get(t, -1 - i) for i, t in enumerate(tokens)], dtype=np.int64)

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        """token → id, built once: a query's tokens are looked up for every batch."""
        return {t: i for i, t in enumerate(self.tokens)}
