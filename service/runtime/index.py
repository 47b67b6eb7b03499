"""The catalog's vector index: the interface every path searches, and FAISS in-process.

`VectorIndex`: top-k for many unit vectors at once (inner product is cosine), under an optional
metadata filter, vectors by row, and a health check. Backends: `FaissIndex` (any FAISS
`index_factory` string) and `service.runtime.milvus.MilvusIndex` (an external engine).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import faiss
import numpy as np

from service.errors import BundleError
from service.runtime.filters import RowFilter, Where

EXACT = "Flat"
# FAISS's `distance_compute_blas_threshold` picks exact search's kernel; NO_BLAS is the
# faiss-cpu wheel's own setting. The BLAS kernel is slower per probe for calls of few probes and
# faster for many, so calls of fewer than BLAS_FROM probes keep the wheel's setting.
BLAS_THRESHOLD = 16
BLAS_FROM = 8
NO_BLAS = 128_000
# Exact search keeps every vector in memory as float32; past this size ask for a factory.
MAX_EXACT_ITEMS = 1_000_000


def use_blas_kernel(probes: int = BLAS_FROM) -> None:
    """Pick exact search's kernel for a call of `probes` probes (a process-wide FAISS knob:
    a race between threads only picks the slower kernel for one call)."""
    faiss.cvar.distance_compute_blas_threshold = BLAS_THRESHOLD if probes >= BLAS_FROM \
        else NO_BLAS


def build_index(embeddings: np.ndarray, factory: str | None = None) -> faiss.Index:
    """Build an inner-product index over (N, D) float32 unit vectors."""
    use_blas_kernel()
    vectors = np.ascontiguousarray(embeddings, dtype=np.float32)
    _, dim = vectors.shape
    index = faiss.index_factory(dim, factory or EXACT, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        index.train(vectors)
    index.add(vectors)
    return index


class VectorIndex(Protocol):
    """What every path searches: the catalog's rows by inner product."""

    backend: str
    ntotal: int

    def search(self, queries: np.ndarray, k: int,
               where: Where | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), both (Q, k), best first; rows are -1 where fewer match."""
        ...

    def vectors(self, rows: np.ndarray) -> np.ndarray:
        """(n, d) float32 stored vectors of catalog rows (n,)."""
        ...

    def check(self) -> None:
        """Raise IndexUnavailableError when the index cannot answer now."""
        ...

    def describe(self) -> dict[str, Any]: ...


class FaissIndex:
    """The catalog in-process: a FAISS index over the bundle's rows; filters select rows by
    the items' metadata and FAISS searches only those (an IDSelector, inside the search)."""

    backend = "faiss"

    def __init__(self, index: faiss.Index, metadata: Sequence[Mapping[str, object]] = (),
                 choice: str = "bundle", embeddings: np.ndarray | None = None) -> None:
        self.faiss, self.choice, self.embeddings = index, choice, embeddings
        self.filter = RowFilter(metadata)

    @property
    def ntotal(self) -> int:
        return int(self.faiss.ntotal)

    def search(self, queries: np.ndarray, k: int,
               where: Where | None = None) -> tuple[np.ndarray, np.ndarray]:
        use_blas_kernel(len(queries))
        if not where:
            return self.faiss.search(queries, k)
        allowed = self.filter.rows(where)  # (M,) kept alive through the search
        selector = faiss.IDSelectorBatch(allowed)
        params = self._params(selector)
        if params is None:  # a type FAISS cannot filter inside: exact among the rows
            return self._exact_among(queries, k, allowed)
        scores, rows = self.faiss.search(queries, k, params=params)
        short = np.flatnonzero((rows < 0).sum(axis=1) > max(0, k - len(allowed)))
        if len(short):  # a graph index can miss a sparse filter's rows: search them exactly
            scores[short], rows[short] = self._exact_among(queries[short], k, allowed)
        return scores, rows

    def _exact_among(self, queries: np.ndarray, k: int,
                     allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k among `allowed` rows (M,), as Milvus does for a selective filter."""
        stored = self.embeddings[allowed] if self.embeddings is not None \
            else self.vectors(allowed)  # (M, d): the catalog's own rows when held
        sims = queries @ stored.T  # (Q, M)
        top = np.argsort(-sims, axis=1, kind="stable")[:, :k]  # (Q, ≤ k)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        rows = np.full((len(queries), k), -1, dtype=np.int64)
        scores[:, : top.shape[1]] = np.take_along_axis(sims, top, axis=1)
        rows[:, : top.shape[1]] = allowed[top]
        return scores, rows

    def _params(self, selector: faiss.IDSelector) -> faiss.SearchParameters | None:
        """Search parameters carrying the selector and the index's own search-time settings
        (FAISS would otherwise search HNSW at efSearch 16, IVF at nprobe 1); None for a type
        that takes none (a transform or refinement wrapper)."""
        index = self.faiss
        if isinstance(index, faiss.IndexHNSW):
            return faiss.SearchParametersHNSW(sel=selector, efSearch=index.hnsw.efSearch)
        if isinstance(index, faiss.IndexIVF):
            return faiss.SearchParametersIVF(sel=selector, nprobe=index.nprobe)
        if isinstance(index, faiss.IndexFlat):
            return faiss.SearchParameters(sel=selector)
        return None

    def vectors(self, rows: np.ndarray) -> np.ndarray:
        return self.faiss.reconstruct_batch(np.asarray(rows, dtype=np.int64))

    def check(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "index": type(self.faiss).__name__,
                "choice": self.choice, "rows": self.ntotal}


MILVUS = "milvus"


@dataclass(frozen=True)
class IndexChoice:
    """The index every path searches: the bundle's own (`factory` empty: exact, as built), or
    one FAISS's index_factory builds at load over the bundle's embeddings (e.g. "HNSW32"),
    so an approximate index is chosen at serving time without rebuilding the bundle;
    `params` are its search-time parameters (a ParameterSpace string, e.g. "efSearch=128").
    "milvus" is the collection the bundle records (`r4t index`), at its recorded URI or at
    `uri` ("milvus://host:port"): replicas then hold no index."""

    factory: str = ""
    params: str = ""
    uri: str = ""

    @property
    def name(self) -> str:
        if self.factory == MILVUS:
            return self.uri or MILVUS
        return "/".join(p for p in (self.factory or "bundle", self.params) if p)

    @property
    def engine(self) -> bool:
        return self.factory == MILVUS

    @classmethod
    def parse(cls, name: str) -> IndexChoice:
        """The inverse of `name`: "bundle", "HNSW32", "HNSW32/efSearch=128", "milvus",
        "milvus://host:19530"."""
        if name == MILVUS or name.startswith(f"{MILVUS}://"):
            return cls(MILVUS, uri="" if name == MILVUS else name)
        factory, _, params = name.partition("/")
        return cls("" if factory == "bundle" else factory, params)


def chosen_index(own: faiss.Index, embeddings: np.ndarray, choice: IndexChoice) -> faiss.Index:
    """`own` (the bundle's index) or the index `choice` builds over the same rows."""
    try:
        index = build_index_once(embeddings, choice.factory) if choice.factory else own
        if choice.params:
            faiss.ParameterSpace().set_index_parameters(index, choice.params)
    except RuntimeError as exc:  # FAISS's message ends with what it could not parse or set
        reason = str(exc).strip().splitlines()[-1].rsplit(": ", 1)[-1]
        raise BundleError(f"index {choice.name!r}: {reason}") from exc
    return index


def build_index_once(embeddings: np.ndarray, factory: str) -> faiss.Index:
    """build_index on one thread: FAISS's parallel HNSW insertion makes a different graph on
    each build, and replicas of one bundle must answer alike."""
    searching = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        return build_index(embeddings, factory)
    finally:
        faiss.omp_set_num_threads(searching)


def save_index(index: faiss.Index, path: Path) -> None:
    faiss.write_index(index, str(path))


def load_index(path: Path) -> faiss.Index:
    use_blas_kernel()
    return faiss.read_index(str(path))


def as_index(index: VectorIndex | faiss.Index) -> VectorIndex:
    """A backend as is; a bare FAISS index (as `build_index` returns) in-process, unfiltered."""
    return FaissIndex(index) if isinstance(index, faiss.Index) else index


def search(index: VectorIndex | faiss.Index, queries: np.ndarray, k: int,
           where: Where | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-k by inner product: (scores, rows), both (Q, k); rows are -1 where fewer exist."""
    vectors = np.ascontiguousarray(queries, dtype=np.float32)
    if vectors.ndim != 2:
        raise ValueError(f"queries must be (Q, D), got shape {vectors.shape}")
    k = min(k, index.ntotal)
    scores, rows = as_index(index).search(vectors, k, where)
    return scores, rows.astype(np.int64, copy=False)


def search_each(index: VectorIndex, queries: np.ndarray, k: int,
                wheres: Sequence[Where | None]) -> tuple[np.ndarray, np.ndarray]:
    """`search` with a filter per query (Q,): one search per distinct filter."""
    if not any(wheres):
        return search(index, queries, k)
    k = min(k, index.ntotal)
    scores = np.empty((len(queries), k), dtype=np.float32)  # (Q, k)
    rows = np.empty((len(queries), k), dtype=np.int64)  # (Q, k)
    for where in dict.fromkeys(wheres):
        members = [i for i, w in enumerate(wheres) if w == where]
        scores[members], rows[members] = search(index, queries[members], k, where)
    return scores, rows


def neighbour_rows(index: VectorIndex | faiss.Index, queries: np.ndarray, n: int) -> np.ndarray:
    """(Q, n) catalog rows of each query's n nearest items, best first.

    Where the index finds fewer than n (a catalog smaller than n, or an approximate index),
    the found rows repeat in order, so the shape is always (Q, n): the diffusion model's
    context (training.stage3_diffusion.denoiser, `context`) has a fixed size.
    """
    if len(queries) == 0:
        return np.zeros((0, n), dtype=np.int64)
    _, found = search(index, queries, n)  # (Q, ≤ n), -1 where fewer exist
    if found.shape[1] == n and (found >= 0).all():  # the usual case, no per-query loop
        return found
    out = np.empty((len(found), n), dtype=np.int64)
    for i, row in enumerate(found):
        valid = row[row >= 0]
        if len(valid) == 0:
            raise ValueError(f"the index found no neighbours for query {i}")
        out[i] = np.resize(valid, n)  # (n,): the found rows, cycled
    return out


def neighbourhood(index: VectorIndex | faiss.Index, embeddings: np.ndarray, queries: np.ndarray,
                  n: int) -> np.ndarray:
    """(Q, n, d) embeddings of each query's n nearest catalog items, best first."""
    rows = neighbour_rows(index, queries, n)  # (Q, n)
    return np.ascontiguousarray(embeddings[rows], dtype=np.float32)


def set_threads(n: int) -> None:
    """Cap FAISS's OpenMP threads in the calling thread (OpenMP keeps the cap per thread, so
    each thread that searches sets it; the service shares two cores with ONNX Runtime)."""
    faiss.omp_set_num_threads(max(1, n))
