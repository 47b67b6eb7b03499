"""`r4t index milvus://host:port/collection`: load a bundle's catalog into a Milvus collection
and record it in the bundle (stage "milvus"), so that `R4T_INDEX=milvus` serves from it.

The collection's primary key is the catalog row, its vector the item's embedding (inner
product), and the items' metadata its dynamic fields, so request filters run in the engine.
Its `r4t.checksum` property is the catalog stage's hash; the service refuses a collection
whose checksum or size differ from its bundle's (service.runtime.milvus).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from service.artifacts.bundle import config_hash, read_manifest, stage, stage_hash
from service.artifacts.items import ItemStore
from service.errors import BundleError
from service.runtime.milvus import (
    CHECKSUM_PROPERTY,
    CLIENT_OPTIONS,
    MILVUS_STAGE,
    ROW_FIELD,
    VECTOR_FIELD,
    engine_address,
    engine_reason,
)

ENGINE_INDEXES = ("FLAT", "HNSW")  # FLAT: exact, the same items as FAISS flat
INSERT_CHUNK = 5_000
LOAD_TIMEOUT_S = 600.0


def collection_schema(client: Any, dim: int) -> Any:
    from pymilvus import DataType

    schema = client.create_schema(auto_id=False, enable_dynamic_field=True)
    schema.add_field(ROW_FIELD, DataType.INT64, is_primary=True)
    schema.add_field(VECTOR_FIELD, DataType.FLOAT_VECTOR, dim=dim)
    return schema


def index_params(client: Any, index_type: str) -> Any:
    params = client.prepare_index_params()
    extra = {"params": {"M": 32, "efConstruction": 200}} if index_type == "HNSW" else {}
    params.add_index(field_name=VECTOR_FIELD, index_type=index_type, metric_type="IP", **extra)
    return params


def fill_collection(client: Any, name: str, items: ItemStore, index_type: str,
                    checksum: str) -> None:
    """(Re)create collection `name` holding `items`, then load it for search."""
    if client.has_collection(name, timeout=LOAD_TIMEOUT_S):
        client.drop_collection(name, timeout=LOAD_TIMEOUT_S)
    client.create_collection(name, schema=collection_schema(client, items.embeddings.shape[1]),
                             index_params=index_params(client, index_type),
                             properties={CHECKSUM_PROPERTY: checksum}, timeout=LOAD_TIMEOUT_S)
    metadata = items.metadata or [{} for _ in items.ids]
    with tqdm(total=len(items.ids), desc=f"milvus: load {name}", unit="item") as bar:
        for start in range(0, len(items.ids), INSERT_CHUNK):
            stop = min(start + INSERT_CHUNK, len(items.ids))
            client.insert(name, [
                {**metadata[row], ROW_FIELD: row, VECTOR_FIELD: items.embeddings[row].tolist()}
                for row in range(start, stop)], timeout=LOAD_TIMEOUT_S)
            bar.update(stop - start)
    client.flush(name, timeout=LOAD_TIMEOUT_S)  # a server counts rows of flushed segments
    client.load_collection(name, timeout=LOAD_TIMEOUT_S)


def check_metadata(items: ItemStore) -> None:
    """Refuse metadata fields that would overwrite the collection's own."""
    taken = {ROW_FIELD, VECTOR_FIELD} & {k for record in items.metadata for k in record}
    if taken:
        raise BundleError(f"catalog metadata fields {sorted(taken)} clash with the "
                          "collection's own fields; rename them in the catalog")


def load_into_milvus(bundle_dir: Path, uri: str, index_type: str = "FLAT") -> dict[str, Any]:
    """Load the bundle's catalog into the collection `uri` names; returns the stage record."""
    from pymilvus import MilvusClient

    address, name = engine_address(uri)
    if not name:
        raise BundleError(f"engine URI {uri!r} names no collection: milvus://host:port/NAME")
    if index_type not in ENGINE_INDEXES:
        raise BundleError(f"engine index {index_type!r}: use one of {ENGINE_INDEXES}")
    manifest = read_manifest(bundle_dir)
    checksum = stage_hash(manifest, "catalog")
    if checksum is None:
        raise BundleError(f"bundle {bundle_dir} has no catalog: run `r4t catalog` first")
    items = ItemStore.load(bundle_dir)
    check_metadata(items)
    started = time.monotonic()
    try:
        client = MilvusClient(uri=address, timeout=LOAD_TIMEOUT_S, **CLIENT_OPTIONS)
        try:
            fill_collection(client, name, items, index_type, checksum)
        finally:
            client.close()
    except Exception as exc:  # the engine's own errors, with its reason
        raise BundleError(f"milvus at {address}: {engine_reason(exc)}") from exc
    config = {"address": address, "collection": name, "index_type": index_type}
    record = {"config": config, "config_hash": config_hash(config), **config,
              "checksum": checksum, "rows": len(items.ids),
              "dim": int(items.embeddings.shape[1]), "files": [],
              "wall_s": round(time.monotonic() - started, 2)}
    with stage(bundle_dir, manifest, MILVUS_STAGE, record):
        pass
    return record
