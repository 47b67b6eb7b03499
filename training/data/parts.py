"""Which parts of an item's text the catalog stage embeds (service.artifacts.parts): for
WordNet's "lemma1, lemma2: gloss" and for a catalog of bare names alike (a part a text lacks is
the empty string, whose embedding is zero)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from service.artifacts.lexical import WORD
from service.fanout.format import item_name

# the name (every lemma), the first name, its head word, the description, its first 3 words
# (where a gloss names its genus) and its first 6
PART_NAMES = ("names", "first", "head", "description", "description3", "description6")


def part_texts(text: str) -> tuple[str, ...]:
    """One text per PART_NAMES entry."""
    names, colon, described = text.partition(":")
    described = described if colon else ""
    first = item_name(text)
    head = WORD.findall(first.lower())
    words = described.split()
    return (names.strip(), first, head[-1] if head else "", described.strip(),
            " ".join(words[:3]), " ".join(words[:6]))


def embed_parts(texts: list[str], dim: int,
                embed: Callable[[list[str], str], np.ndarray]) -> np.ndarray:
    """(M, P, dim) float16: every part of every text embedded by `embed` (texts, progress
    label) → (N, dim) unit rows."""
    split = [part_texts(t) for t in texts]
    out = np.zeros((len(texts), len(PART_NAMES), dim), dtype=np.float16)
    for p, name in enumerate(PART_NAMES):
        column = [parts[p] for parts in split]
        present = [i for i, t in enumerate(column) if t]
        if present:
            vectors = embed([column[i] for i in present], f"parts: {name}")
            out[present, p] = vectors.astype(np.float16)
    return out
