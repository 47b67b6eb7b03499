"""The catalog's lexical index: SQLite FTS5 over item texts, ranked by BM25 (bm25s, in memory).

A broad query's dense neighbours are near-synonyms; the texts that *mention* it reach what it
covers. FTS5 ships in Python's sqlite3 as one checksummed file: no extra engine. Tokens are
Porter-stemmed Unicode words; the catalog's most frequent words are dropped from a query that
has others, as they rank nothing and cost far more than a rare word to score.
"""

from __future__ import annotations

import functools
import re
import sqlite3
import threading
from collections import Counter
from collections.abc import Container, Sequence
from pathlib import Path

import bm25s
import numpy as np
from cachetools import LRUCache, cached

LEXICAL_FILE = "lexical.sqlite"
TOKENIZER = "porter unicode61 remove_diacritics 2"
WORD = re.compile(r"[^\W_]+", re.UNICODE)  # letters and digits: unicode61 splits at "_"
K1, B = 1.2, 0.75  # FTS5's bm25() constants
FTS5_IDF_FLOOR = 1e-6  # FTS5's idf for a token in half the texts or more (Robertson's is ≤ 0)
MAX_DF = 0.05  # share of texts above which a word is too common to search for
MAX_QUERY_WORDS = 16  # words of a query searched: a long query costs no more than this many
POSTINGS_BUDGET = 200_000  # postings one search reads at most (a query of frequent words)
QUERY_IDS_CACHED = 4096  # query texts whose token ids are kept (a batch's, and repeats)


def words(text: str) -> list[str]:
    """The distinct lowercase words of `text`, in order."""
    return list(dict.fromkeys(WORD.findall(text.lower())))


def frequent_words(texts: Sequence[str], max_df: float = MAX_DF) -> list[str]:
    """The words found in more than `max_df` of `texts`."""
    df = Counter(w for text in texts for w in set(WORD.findall(text.lower())))
    return sorted(w for w, n in df.items() if n > max_df * len(texts))


def build_lexical_index(path: Path, texts: Sequence[str]) -> None:
    """Write an FTS5 table of `texts` (rowid = catalog row) and the catalog's frequent words
    to `path`."""
    path.unlink(missing_ok=True)
    with sqlite3.connect(path) as db:
        db.execute(f"CREATE VIRTUAL TABLE items USING fts5(text, tokenize='{TOKENIZER}')")
        db.executemany("INSERT INTO items(rowid, text) VALUES (?, ?)",
                       ((row, text) for row, text in enumerate(texts)))
        db.execute("INSERT INTO items(items) VALUES ('optimize')")
        db.execute("CREATE TABLE frequent(word TEXT PRIMARY KEY)")
        db.executemany("INSERT INTO frequent VALUES (?)", ((w,) for w in frequent_words(texts)))
    db.close()


def query_words(query: str, frequent: Container[str] = ()) -> list[str]:
    """The query's first MAX_QUERY_WORDS words but the frequent ones, unless it has no other."""
    found = words(query)
    return ([w for w in found if w not in frequent] or found)[:MAX_QUERY_WORDS]


class FtsTokenizer:
    """Words → FTS5 tokens, by FTS5 itself (an in-memory table with the index's tokenizer), so a
    query's tokens are the catalog's: stemming and diacritics folded the same way. The words a
    cache lacks are tokenized in one statement, so a text of never-seen words costs one."""

    def __init__(self, cache_size: int = 1 << 16) -> None:
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._lock = threading.Lock()  # one connection and one cache, shared by threads
        self._db.execute(f"CREATE VIRTUAL TABLE q USING fts5(text, tokenize='{TOKENIZER}')")
        self._db.execute("CREATE VIRTUAL TABLE v USING fts5vocab(q, instance)")
        self._cache: LRUCache[str, tuple[str, ...]] = LRUCache(cache_size)

    def tokens_of(self, words: Sequence[str]) -> list[tuple[str, ...]]:
        """Each word's FTS5 tokens."""
        with self._lock:
            found = {w: self._cache.get(w) for w in words}
            missing = [w for w, tokens in found.items() if tokens is None]
            if missing:
                for word, tokens in zip(missing, fts_tokens(self._db, missing), strict=True):
                    self._cache[word] = found[word] = tokens
        return [found[w] for w in words]  # type: ignore[misc]

    def close(self) -> None:
        self._db.close()


def fts_tokens(db: sqlite3.Connection, words: Sequence[str]) -> list[tuple[str, ...]]:
    """Each word's FTS5 tokens, through the tokenizer's table `q` (a row per word) and its
    vocabulary `v`."""
    db.execute("DELETE FROM q")
    db.executemany("INSERT INTO q(rowid, text) VALUES (?, ?)", enumerate(words))
    out: list[list[str]] = [[] for _ in words]
    for row, term in db.execute("SELECT doc, term FROM v ORDER BY doc, offset"):
        out[row].append(term)
    return [tuple(tokens) for tokens in out]


def indexed_tokens(db: sqlite3.Connection, size: int) -> tuple[dict[str, int], list[list[int]]]:
    """(vocabulary token → id, each text's token ids with repeats): the index's own postings,
    read back through FTS5's instance vocabulary."""
    db.execute("CREATE VIRTUAL TABLE IF NOT EXISTS temp.postings "
               "USING fts5vocab(main, items, instance)")
    vocab: dict[str, int] = {}
    pairs = db.execute("SELECT term, doc FROM temp.postings").fetchall()
    terms = np.fromiter((vocab.setdefault(t, len(vocab)) for t, _ in pairs), np.int64, len(pairs))
    docs = np.fromiter((d for _, d in pairs), np.int64, len(pairs))
    order = np.argsort(docs, kind="stable")
    bounds = np.searchsorted(docs[order], np.arange(size + 1))
    ids = terms[order]
    return vocab, [ids[bounds[i] : bounds[i + 1]].tolist() for i in range(size)]


def floor_common_tokens(scores: dict, corpus: list[list[int]]) -> None:
    """Give the tokens in half the texts or more FTS5's idf floor instead of Robertson's 0, so
    texts that match only them still rank by term frequency and length, as in FTS5."""
    n, indptr = len(corpus), scores["indptr"]
    df = np.diff(indptr)  # (V,) texts per token
    common = np.flatnonzero((n - df + 0.5) / (df + 0.5) <= 1)  # FTS5's idf ≤ 0: floored
    if not len(common):
        return
    lengths = np.array([len(doc) for doc in corpus], dtype=np.float64)  # (N,)
    norm = K1 * (1 - B + B * lengths / max(lengths.mean(), 1e-9))  # (N,)
    for token in common.tolist():
        rows = scores["indices"][indptr[token] : indptr[token + 1]]
        tf = np.array([corpus[r].count(token) for r in rows], dtype=np.float64)
        scores["data"][indptr[token] : indptr[token + 1]] = FTS5_IDF_FLOOR * tf / (norm[rows] + tf)


def searched_ids(tokenizer: FtsTokenizer, frequent: Container[str], vocab: dict[str, int],
                 query: str) -> tuple[int, ...]:
    """The vocabulary ids of the query's searched words' tokens (unknown ones dropped)."""
    searched = tokenizer.tokens_of(query_words(query, frequent))
    return tuple(vocab[t] for tokens in searched for t in tokens if t in vocab)


class LexicalIndex:
    """Read-only BM25 search over a bundle's lexical.sqlite, safe to share between threads.

    FTS5 holds the texts and tokenizes; ranking runs in bm25s over the same tokens with FTS5's
    constants, so it returns FTS5's own `ORDER BY rank` lists faster (FTS5's bm25() is paid
    per matching text, which a broad query has thousands of).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        (self.size,) = self._db.execute("SELECT count(*) FROM items").fetchone()
        has_list = self._db.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table' "
                                    "AND name = 'frequent'").fetchone()[0]
        self.frequent = frozenset(w for (w,) in self._db.execute("SELECT word FROM frequent")
                                  ) if has_list else frozenset()
        self.vocab, corpus = indexed_tokens(self._db, self.size)
        self._db.close()  # everything searched is in memory from here on
        self._bm25 = bm25s.BM25(method="robertson", k1=K1, b=B, dtype="float64")
        self._bm25.index(bm25s.tokenization.Tokenized(ids=corpus, vocab=self.vocab),
                         show_progress=False)
        floor_common_tokens(self._bm25.scores, corpus)
        self._start = self._bm25.scores["indptr"].tolist()  # token → its postings' bounds
        self._postings = self._bm25.scores["indices"]  # (P,) rows, sorted within a token
        self._df = np.diff(self._bm25.scores["indptr"]).tolist()  # token → texts holding it
        self.tokenizer = FtsTokenizer()
        # a query's ids are read three times a batch (its BM25 list, its mentions, its features);
        # the cached function holds the tokenizer and vocabulary, not the index: no cycle keeps a
        # retired bundle from being freed by reference counting
        self._ids = cached(LRUCache(QUERY_IDS_CACHED), lock=threading.Lock())(
            functools.partial(searched_ids, self.tokenizer, self.frequent, self.vocab))

    def token_ids(self, query: str) -> list[int]:
        """The vocabulary ids of the query's searched words' tokens (unknown ones dropped)."""
        return list(self._ids(query))

    def breadth(self, query: str) -> int:
        """How many texts hold every searched word of the query: words the catalog never uses
        are not searched (token_ids), so a typo leaves the rest of the query's breadth."""
        return len(self.mentions(query))

    def mentions(self, query: str) -> np.ndarray:
        """The rows (ascending) of the texts holding every searched word of the query."""
        return self.holding(self.token_ids(query))

    def holding(self, ids: list[int]) -> np.ndarray:
        """The rows (ascending) of the texts holding every token of `ids`: the rarest token's
        texts, kept where a binary search finds them in each other token's postings (sorted by
        row), one vectorised lookup per token."""
        ids = list(ids)
        if not ids:
            return np.zeros(0, dtype=np.int64)
        ids.sort(key=self._df.__getitem__)
        start = self._start[ids[0]]
        common = self._postings[start : start + self._df[ids[0]]]  # (M,) the rarest's rows
        for token in ids[1:]:
            start, size = self._start[token], self._df[token]
            other = self._postings[start : start + size]  # (N,) sorted rows
            common = common[other[np.minimum(np.searchsorted(other, common), size - 1)] == common]
        return common.astype(np.int64)

    def search(self, queries: Sequence[str], n: int) -> list[np.ndarray]:
        """Per query, up to n catalog rows whose text shares a word with it, best BM25 first."""
        return [self._ranked(self.token_ids(query), n) for query in queries]

    def _ranked(self, ids: list[int], n: int) -> np.ndarray:
        """BM25 over the texts holding a query token only (bm25s scores every text): each
        text's token scores summed in token order, as bm25s's own sum does; ties by row.
        Per query, not for the batch at once: small sorts stay in cache, and one sort of a
        whole batch's postings measured slower."""
        if not ids or n <= 0:
            return np.zeros(0, dtype=np.int64)
        ids = self._within_budget(ids)
        postings, bounds = self._bm25.scores, [(self._start[t], self._start[t + 1]) for t in ids]
        rows = np.concatenate([postings["indices"][a:b] for a, b in bounds])  # (M,)
        scores = np.concatenate([postings["data"][a:b] for a, b in bounds])  # (M,)
        if len(ids) > 1:  # one token's postings are distinct texts already
            rows, inverse = np.unique(rows, return_inverse=True)  # every text with a query token
            scores = np.bincount(inverse, weights=scores, minlength=len(rows))  # (U,)
        if len(rows) > n:  # only the texts scoring at least the n-th best need ordering
            best = scores >= np.partition(scores, len(scores) - n)[len(scores) - n]
            rows, scores = rows[best], scores[best]
        return rows[np.lexsort((rows, -scores))][:n].astype(np.int64)

    def _within_budget(self, ids: list[int]) -> list[int]:
        """The query's tokens in order, but the commonest dropped while their postings together
        pass POSTINGS_BUDGET (a query of frequent words would sum the catalog's postings)."""
        kept, total = set(), 0
        for token in sorted(dict.fromkeys(ids), key=self._df.__getitem__):
            total += self._df[token]
            if kept and total > POSTINGS_BUDGET:
                break
            kept.add(token)
        return [t for t in ids if t in kept]

    def close(self) -> None:
        self.tokenizer.close()  # the catalog's connection closed once read
