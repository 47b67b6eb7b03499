"""The item side compiled offline: per item, the embeddings of parts of its text (its name, its
first name's head word, its description's first words), written by the catalog stage.

Where a query's words sit in an item's text ("tent: a portable shelter") tells its kind, and one
embedding of the whole text averages that away; a cosine per part keeps it without a ranker.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.errors import BundleError

PARTS_FILE = "parts.npy"  # (M, P, d) float16, row-aligned with the catalog


@dataclass(frozen=True)
class ItemParts:
    """The catalog's part embeddings (memory-mapped) and the names of the parts, in order."""

    names: tuple[str, ...]
    vectors: np.ndarray  # (M, P, d) float16

    @classmethod
    def load(cls, bundle_dir: Path, names: tuple[str, ...], n_items: int) -> ItemParts:
        path = Path(bundle_dir) / PARTS_FILE
        if not path.is_file():
            raise BundleError(f"bundle {bundle_dir} has no {PARTS_FILE}: `r4t --bundle "
                              f"{bundle_dir} catalog` builds it")
        vectors = np.load(path, mmap_mode="r")
        if vectors.ndim != 3 or vectors.shape[:2] != (n_items, len(names)):
            raise BundleError(f"{path} holds {vectors.shape}, not ({n_items}, {len(names)}, d)")
        return cls(tuple(names), vectors)

    def similarities(self, rows: np.ndarray, queries: np.ndarray) -> np.ndarray:
        """(B, C, P) float32 cosines of each query (B, d) to each part of its rows (B, C)."""
        parts = np.asarray(self.vectors[rows.reshape(-1)], dtype=np.float32)  # (B·C, P, d)
        parts = parts.reshape(*rows.shape, *self.vectors.shape[1:])  # (B, C, P, d)
        return np.einsum("bcpd,bd->bcp", parts, queries.astype(np.float32))


def context_features(context: np.ndarray, parts: ItemParts | None, rows: np.ndarray,
                     queries: np.ndarray | None, mentions: np.ndarray | None = None
                     ) -> np.ndarray:
    """(B, C, d [+ P] [+ M]) what a student's context holds of its rows (B, C): their
    embeddings `context` (B, C, d), with `parts` the query's cosine to each of their parts, and
    the mention columns `mentions` (B, C, M) when given
    (service.ranker.mention_context)."""
    columns = [context]
    if parts is not None and queries is not None:
        columns.append(parts.similarities(rows, queries))
    if mentions is not None:
        columns.append(mentions)
    return np.ascontiguousarray(columns[0]) if len(columns) == 1 else np.concatenate(
        columns, axis=-1)
