"""The catalog's lexical index: SQLite FTS5 over item texts, ranked by BM25.

Dense neighbours of a broad query are its near-synonyms; the items whose text *mentions* the
query reach much more of what it covers. FTS5 ships inside Python's sqlite3, keeps the index
in one file (checksummed with the bundle) and answers a query in well under a millisecond at
catalog sizes of 10^5, so no extra engine is needed. Tokens: Unicode-aware words with Porter
stemming, so "instruments" finds "instrument"; nothing here knows the catalog's text format.
Words in more than MAX_DF of the catalog's texts ("of", "the" in English glosses) are dropped
from a query that has other words: they rank nothing, and scoring their tens of thousands of
matches costs 100× a rare word's lookup ("head of state": 250 ms). The list is the catalog's
own, computed when the index is built.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from collections import Counter
from collections.abc import Container, Sequence
from pathlib import Path

import numpy as np

LEXICAL_FILE = "lexical.sqlite"
TOKENIZER = "porter unicode61 remove_diacritics 2"
WORD = re.compile(r"\w+", re.UNICODE)
MAX_DF = 0.05  # share of texts above which a word is too common to search for


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


def match_expression(query: str, frequent: Container[str] = ()) -> str | None:
    """Any of the query's words but the frequent ones, unless it has no other (quoted, so no
    FTS5 syntax leaks in); None when it has no word."""
    found = words(query)
    kept = [w for w in found if w not in frequent] or found
    return " OR ".join(f'"{w}"' for w in kept) if kept else None


class LexicalIndex:
    """Read-only BM25 search over a bundle's lexical.sqlite, safe to share between threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        self._lock = threading.Lock()  # one sqlite3 connection: calls are serialised
        (self.size,) = self._db.execute("SELECT count(*) FROM items").fetchone()
        has_list = self._db.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table' "
                                    "AND name = 'frequent'").fetchone()[0]
        self.frequent = frozenset(w for (w,) in self._db.execute("SELECT word FROM frequent")
                                  ) if has_list else frozenset()

    def search(self, queries: Sequence[str], n: int) -> list[np.ndarray]:
        """Per query, up to n catalog rows whose text shares a word with it, best BM25 first."""
        out = []
        with self._lock:
            for query in queries:
                expression = match_expression(query, self.frequent)
                rows = [] if expression is None else [r for (r,) in self._db.execute(
                    "SELECT rowid FROM items WHERE items MATCH ? ORDER BY rank LIMIT ?",
                    (expression, n))]
                out.append(np.asarray(rows, dtype=np.int64))
        return out

    def close(self) -> None:
        self._db.close()
