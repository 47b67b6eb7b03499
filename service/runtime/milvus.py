"""The catalog in Milvus (pymilvus's `MilvusClient`): replicas hold no index, only the item store.

One code for Milvus Lite, standalone and a cluster: only the URI differs. `r4t index` loads a
collection and records it in the manifest; every connection checks that it holds that catalog
(checksum, row count). Every call has a timeout: a down engine is an `IndexUnavailableError`
(503), never a hang, and the client is rebuilt after a failure.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from service.errors import BundleError, IndexUnavailableError
from service.runtime.filters import Where, expression

MILVUS_STAGE = "milvus"
CHECKSUM_PROPERTY = "r4t.checksum"
ROW_FIELD, VECTOR_FIELD = "row", "vector"
DEFAULT_PORT = 19530
# Each replica its own connection (a shared one keeps a broken channel across reconnects), and
# no keep-alive pings while idle: every call has its own deadline, and an engine that allows
# no idle pings (Milvus Lite, gRPC's default) ends the channel with "too many pings".
CLIENT_OPTIONS = {"dedicated": True, "grpc_options": {
    "grpc.keepalive_permit_without_calls": 0, "grpc.keepalive_time_ms": 300_000}}


def engine_address(uri: str) -> tuple[str, str]:
    """"milvus://host:port/collection" → ("http://host:port", collection or "")."""
    parts = urlsplit(uri)
    if parts.scheme not in ("milvus", "http", "https") or not parts.hostname:
        raise BundleError(f"engine URI {uri!r}: expected milvus://host:port[/collection]")
    scheme = "https" if parts.scheme == "https" else "http"
    return f"{scheme}://{parts.hostname}:{parts.port or DEFAULT_PORT}", parts.path.strip("/")


def close(client: Any) -> None:
    with contextlib.suppress(Exception):
        client.close()


def engine_reason(exc: BaseException) -> str:
    """pymilvus's message without its code prefix and the gRPC debug dump."""
    text = str(getattr(exc, "message", "") or exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


class MilvusIndex:
    """One verified Milvus collection holding the bundle's catalog, rows as primary keys."""

    backend = "milvus"

    def __init__(self, address: str, collection: str, checksum: str, rows: int, dim: int,
                 timeout_s: float) -> None:
        self.address, self.collection, self.checksum = address, collection, checksum
        self.ntotal, self.d, self.timeout_s = int(rows), int(dim), float(timeout_s)
        self._client: Any = None
        self._lock = threading.RLock()  # one client build at a time
        self.client()  # connects, refuses a collection not the bundle's (BundleError)

    @classmethod
    def of_record(cls, record: dict[str, Any], uri: str, timeout_s: float) -> MilvusIndex:
        """From the bundle's "milvus" stage record; `uri` ("milvus://host:port") overrides the
        recorded engine address (the same collection seen from elsewhere, e.g. a pod)."""
        address = engine_address(uri)[0] if uri else str(record["address"])
        return cls(address, str(record["collection"]), str(record["checksum"]),
                   int(record["rows"]), int(record["dim"]), timeout_s)

    def _connect(self) -> Any:
        from pymilvus import MilvusClient  # only a bundle served from Milvus needs it

        return self._call(lambda: MilvusClient(uri=self.address, timeout=self.timeout_s,
                                               **CLIENT_OPTIONS))

    def client(self) -> Any:
        """The connected client, the collection checked and loaded: on first use and after a
        failure, since an engine that restarted may hold the collection released, or another."""
        with self._lock:
            if self._client is None:
                client = self._connect()
                try:
                    self._check_collection(client)
                    self._call(lambda: client.load_collection(self.collection,
                                                              timeout=self.timeout_s))
                except Exception:
                    close(client)
                    raise
                self._client = client
            return self._client

    def _call(self, work: Any, client: Any = None) -> Any:
        try:
            return work()
        except Exception as exc:  # pymilvus raises MilvusException and gRPC errors alike
            if client is not None:
                self._drop(client)  # the next call connects afresh
            raise IndexUnavailableError(f"milvus at {self.address}: "
                                        f"{engine_reason(exc)}") from exc

    def _drop(self, failed: Any) -> None:
        """Forget `failed` if it is still the client (another thread may have replaced it)."""
        with self._lock:
            if self._client is failed:
                self._client = None
        close(failed)

    def _check_collection(self, client: Any) -> None:
        if not self._call(lambda: client.has_collection(self.collection,
                                                        timeout=self.timeout_s)):
            raise BundleError(f"milvus at {self.address} has no collection "
                              f"{self.collection!r}: run `r4t index` to load it")
        found = self._call(lambda: client.describe_collection(self.collection,
                                                              timeout=self.timeout_s))
        held = (found.get("properties") or {}).get(CHECKSUM_PROPERTY)
        stats = self._call(lambda: client.get_collection_stats(self.collection,
                                                               timeout=self.timeout_s))
        rows = int(stats.get("row_count", -1))
        if held != self.checksum or rows != self.ntotal:
            raise BundleError(
                f"milvus collection {self.collection!r} does not match the bundle: checksum "
                f"{held} with {rows} rows, the bundle's {self.checksum} with {self.ntotal}")

    def search(self, queries: np.ndarray, k: int,
               where: Where | None = None) -> tuple[np.ndarray, np.ndarray]:
        client = self.client()
        hits = self._call(lambda: client.search(
            self.collection, data=queries.tolist(), limit=k, output_fields=[ROW_FIELD],
            filter=expression(where) if where else "",
            search_params={"metric_type": "IP"}, timeout=self.timeout_s), client)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)  # (Q, k)
        rows = np.full((len(queries), k), -1, dtype=np.int64)  # (Q, k)
        for i, found in enumerate(hits):
            for j, hit in enumerate(found[:k]):
                rows[i, j], scores[i, j] = int(hit[ROW_FIELD]), float(hit["distance"])
        return scores, rows

    def vectors(self, rows: np.ndarray) -> np.ndarray:
        client, wanted = self.client(), [int(r) for r in rows]
        found = self._call(lambda: client.get(self.collection, ids=wanted,
                                              output_fields=[VECTOR_FIELD],
                                              timeout=self.timeout_s), client)
        by_row = {int(f[ROW_FIELD]): f[VECTOR_FIELD] for f in found}
        return np.asarray([by_row[r] for r in wanted], dtype=np.float32).reshape(-1, self.d)

    def check(self) -> None:
        client = self.client()
        state = self._call(lambda: client.get_load_state(self.collection,
                                                         timeout=self.timeout_s), client)
        if "Loaded" not in str(state.get("state", "")):
            self._drop(client)  # the next call loads it again
            raise IndexUnavailableError(f"milvus at {self.address}: collection "
                                        f"{self.collection!r} is {state.get('state')}")

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "address": self.address,
                "collection": self.collection, "rows": self.ntotal}
