"""The item store: ids, texts, metadata and embeddings of the catalog, row-aligned with the
index."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ITEMS_FILE = "items.jsonl"
EMBEDDINGS_FILE = "embeddings.npy"


@dataclass
class ItemStore:
    """Row i of `embeddings` and of the FAISS index is item `ids[i]`."""

    ids: list[str]
    texts: list[str]
    embeddings: np.ndarray  # (N, D) float32, unit rows
    metadata: list[dict] = field(default_factory=list)
    _row_of: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.texts) or len(self.ids) != len(self.embeddings):
            raise ValueError("ids, texts and embeddings must have the same length")
        self._row_of = {item_id: row for row, item_id in enumerate(self.ids)}

    def __len__(self) -> int:
        return len(self.ids)

    def row(self, item_id: str) -> int:
        return self._row_of[item_id]

    def rows(self, item_ids: list[str]) -> np.ndarray:
        """Rows of the ids that exist in the store (unknown ids are dropped)."""
        return np.array([self._row_of[i] for i in item_ids if i in self._row_of], dtype=np.int64)

    def save(self, directory: Path) -> list[str]:
        """Write the store into `directory`; returns the file names written."""
        with (directory / ITEMS_FILE).open("w", encoding="utf-8") as out:
            for i, (item_id, text) in enumerate(zip(self.ids, self.texts, strict=True)):
                meta = self.metadata[i] if self.metadata else {}
                out.write(json.dumps({"id": item_id, "text": text, **meta}) + "\n")
        np.save(directory / EMBEDDINGS_FILE, self.embeddings.astype(np.float32))
        return [ITEMS_FILE, EMBEDDINGS_FILE]

    @classmethod
    def load(cls, directory: Path, mmap: bool = False) -> ItemStore:
        ids: list[str] = []
        texts: list[str] = []
        metadata: list[dict] = []
        with (directory / ITEMS_FILE).open(encoding="utf-8") as lines:
            for line in lines:
                record = json.loads(line)
                ids.append(record.pop("id"))
                texts.append(record.pop("text"))
                metadata.append(record)
        embeddings = np.load(directory / EMBEDDINGS_FILE, mmap_mode="r" if mmap else None)
        return cls(ids=ids, texts=texts, embeddings=embeddings, metadata=metadata)
