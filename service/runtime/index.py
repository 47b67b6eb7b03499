"""FAISS index over the catalog's item embeddings: exact inner product by default.

Any FAISS `index_factory` string (e.g. "HNSW32", "IVF1024,PQ16") can be chosen for large
catalogs; vectors are unit-norm, so inner product is cosine similarity.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from service.errors import BundleError

EXACT = "Flat"
# FAISS's `distance_compute_blas_threshold` picks exact search's kernel; the faiss-cpu wheel
# ships 128000. Measured here (82k × 128-d, k=72, 1 thread, ms per probe): at 128000, 1.7 at
# any call size; at 16, 9.5 for a 1-probe call, 2.3 for 4, 1.4 for 8, 0.6 for 32. So calls of
# fewer than BLAS_FROM probes keep the wheel's setting.
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


@dataclass(frozen=True)
class IndexChoice:
    """The index every path searches: the bundle's own (`factory` empty: exact, as built), or
    one FAISS's index_factory builds at load over the bundle's embeddings (e.g. "HNSW32"),
    so an approximate index is chosen at serving time without rebuilding the bundle;
    `params` are its search-time parameters (a ParameterSpace string, e.g. "efSearch=128")."""

    factory: str = ""
    params: str = ""

    @property
    def name(self) -> str:
        return "/".join(p for p in (self.factory or "bundle", self.params) if p)

    @classmethod
    def parse(cls, name: str) -> IndexChoice:
        """The inverse of `name`: "bundle", "HNSW32", "HNSW32/efSearch=128"."""
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


def search(index: faiss.Index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k by inner product: (scores, rows), both (Q, k); rows are -1 where fewer exist."""
    vectors = np.ascontiguousarray(queries, dtype=np.float32)
    if vectors.ndim != 2:
        raise ValueError(f"queries must be (Q, D), got shape {vectors.shape}")
    k = min(k, index.ntotal)
    use_blas_kernel(len(vectors))
    scores, rows = index.search(vectors, k)
    return scores, rows.astype(np.int64, copy=False)


def neighbour_rows(index: faiss.Index, queries: np.ndarray, n: int) -> np.ndarray:
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


def neighbourhood(index: faiss.Index, embeddings: np.ndarray, queries: np.ndarray,
                  n: int) -> np.ndarray:
    """(Q, n, d) embeddings of each query's n nearest catalog items, best first."""
    rows = neighbour_rows(index, queries, n)  # (Q, n)
    return np.ascontiguousarray(embeddings[rows], dtype=np.float32)


def set_threads(n: int) -> None:
    """Cap FAISS's OpenMP threads in the calling thread (OpenMP keeps the cap per thread, so
    each thread that searches sets it; the service shares two cores with ONNX Runtime)."""
    faiss.omp_set_num_threads(max(1, n))
