"""Catalogs: the default WordNet nouns, or a user's JSONL file of {"id", "text", ...metadata}.

A catalog is validated completely before anything is written to a bundle, so a bad file
stops the build with a message naming the line and leaves the bundle as it was.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from service.errors import CatalogError
from service.runtime.index import MAX_EXACT_ITEMS
from training.data.wordnet import load_nouns

WORDNET = "wordnet"  # the default catalog source's name


@dataclass
class Catalog:
    ids: list[str]
    texts: list[str]
    metadata: list[dict]
    source: str

    def __len__(self) -> int:
        return len(self.ids)


def wordnet_catalog(directory: Path | None = None) -> Catalog:
    """82,115 WordNet 3.0 noun synsets: id = synset offset, text = lemmas and first gloss clause."""
    synsets = load_nouns(directory)
    ids = list(synsets)
    texts = [synsets[i].text() for i in ids]
    return Catalog(ids=ids, texts=texts, metadata=[{} for _ in ids], source=WORDNET)


def _parse_record(line: str, where: str) -> tuple[str, str, dict]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CatalogError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(record, dict):
        raise CatalogError(f"{where}: expected a JSON object, got {type(record).__name__}")
    item_id, text = record.pop("id", None), record.pop("text", None)
    if not isinstance(item_id, str | int) or isinstance(item_id, bool) or str(item_id) == "":
        raise CatalogError(f"{where}: 'id' must be a non-empty string")
    if not isinstance(text, str) or not text.strip():
        raise CatalogError(f"{where}: 'text' is missing or empty")
    return str(item_id), " ".join(text.split()), record


def jsonl_catalog(path: Path, index_factory: str | None = None) -> Catalog:
    """Read and validate a user's catalog; raise CatalogError naming the first bad line."""
    if not path.is_file():
        raise CatalogError(f"catalog file not found: {path}")
    ids: list[str] = []
    texts: list[str] = []
    metadata: list[dict] = []
    first_line: dict[str, int] = {}
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CatalogError(f"{where}: not valid UTF-8 ({exc.reason})") from exc
            if not line.strip():
                continue
            item_id, text, meta = _parse_record(line, where)
            if item_id in first_line:
                raise CatalogError(
                    f"{where}: duplicate id {item_id!r} (first seen on line {first_line[item_id]})"
                )
            first_line[item_id] = number
            ids.append(item_id)
            texts.append(text)
            metadata.append(meta)
            if len(ids) > MAX_EXACT_ITEMS and index_factory is None:
                raise CatalogError(
                    f"{where}: more than {MAX_EXACT_ITEMS:,} items need an approximate index; "
                    "pass --index-factory (e.g. 'HNSW32' or 'IVF4096,PQ32')"
                )
    if not ids:
        raise CatalogError(f"{path}: the catalog holds no items")
    return Catalog(ids=ids, texts=texts, metadata=metadata, source=str(path))


def load_catalog(source: str, index_factory: str | None = None) -> Catalog:
    """`wordnet` for the default catalog, else a path to a JSONL file."""
    if source == WORDNET:
        return wordnet_catalog()
    return jsonl_catalog(Path(source), index_factory)
