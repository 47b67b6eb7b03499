"""Search cost as the catalog grows: per-query seconds of the served index search against
catalog size (the bundle's rows, then synthetic rows up to millions) and batch size, for the
bundle's exact index and the served approximate default, with the approximate index's recall
of the exact top-k. Writes JSON, a markdown table and a PNG plot. Run alone.

Synthetic rows are the bundle's embeddings mixed pairwise with a little noise, renormalised,
so they keep the catalog's geometry (uniform random vectors would flatter exact search and
punish HNSW). Queries are catalog rows perturbed the same way. The search is the service's
own (`service.runtime.index`: `chosen_index`, `search`), at the k the diffusion path's context
lookup asks for.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from loadtest.figure import figure
from loadtest.report import publish
from service.arguments import positive_list
from service.artifacts.bundle import load_bundle
from service.errors import R4TError
from service.fanout.format import PROMPT_RECIPE
from service.runtime.index import (
    FaissIndex,
    IndexChoice,
    build_index,
    chosen_index,
    search,
    set_threads,
)
from service.settings import DEFAULT_BUNDLE, Settings

SIZES = (82_115, 500_000, 2_000_000)
BATCHES = (1, 8, 64, 512)
K = 3 * PROMPT_RECIPE.context  # the hybrid context's dense lookup: 3 × 24 names
QUERIES = 256
REPEATS = 3
MIX, NOISE = 0.5, 0.05  # a synthetic row: e_i + MIX · e_j + NOISE · ε, renormalised


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def synthetic_rows(embeddings: np.ndarray, size: int, seed: int = 0) -> np.ndarray:
    """(size, d): the catalog itself first, then mixtures of its rows."""
    extra = size - len(embeddings)
    if extra <= 0:
        return embeddings[:size]
    rng = np.random.default_rng(seed)
    out = [embeddings]
    for start in range(0, extra, 250_000):  # in chunks: bounded temporary memory
        n = min(250_000, extra - start)
        i, j = rng.integers(0, len(embeddings), (2, n))
        noise = rng.standard_normal((n, embeddings.shape[1]), dtype=np.float32)
        out.append(unit(embeddings[i] + MIX * embeddings[j] + NOISE * noise))
    return np.concatenate(out)


def per_query_s(index: Any, queries: np.ndarray, batch: int) -> float:
    """Fastest of REPEATS passes over `queries` in batches of `batch`, seconds per query."""
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        for start in range(0, len(queries), batch):
            search(index, queries[start : start + batch], K)
        best = min(best, (time.perf_counter() - started) / len(queries))
    return best


def recall(exact: Any, approximate: Any, queries: np.ndarray) -> float:
    """Share of the exact top-K that the approximate index returns."""
    _, want = search(exact, queries, K)
    _, got = search(approximate, queries, K)
    return float(np.mean([len(set(a) & set(b)) / K for a, b in zip(want, got, strict=True)]))


def run(bundle_dir: Path, sizes: tuple[int, ...], choice: str, threads: int) -> dict[str, Any]:
    embeddings = load_bundle(bundle_dir).items.embeddings
    rng = np.random.default_rng(1)
    queries = unit(embeddings[rng.integers(0, len(embeddings), QUERIES)]
                   + NOISE * rng.standard_normal((QUERIES, embeddings.shape[1]),
                                                 dtype=np.float32))
    rows = []
    for size in tqdm(sizes, desc="catalog sizes", unit="size"):
        vectors = synthetic_rows(embeddings, size)
        exact = FaissIndex(build_index(vectors))
        started = time.perf_counter()
        approximate = FaissIndex(chosen_index(exact.faiss, vectors, IndexChoice.parse(choice)))
        build_s = time.perf_counter() - started
        set_threads(threads)  # searches run as served: FAISS capped to its threads
        rows.append({"size": size, "build_s": build_s,
                     "recall": recall(exact, approximate, queries),
                     "exact_s": {b: per_query_s(exact, queries, b) for b in BATCHES},
                     "approximate_s": {b: per_query_s(approximate, queries, b)
                                       for b in BATCHES}})
        del exact, approximate, vectors
    return {"bundle": str(bundle_dir), "index": choice, "k": K, "queries": QUERIES,
            "faiss_threads": threads, "batches": list(BATCHES), "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    head = " | ".join(f"batch {b}: exact / {report['index']}" for b in report["batches"])
    lines = [f"# Search cost vs catalog size (top-{report['k']}, ms per query, "
             f"{report['faiss_threads']} FAISS thread(s), fastest of {REPEATS})", "",
             f"| rows | {head} | recall@{report['k']} | build s |",
             "|---:|" + "---:|" * (len(report["batches"]) + 2)]
    for r in report["rows"]:
        cells = [f"{1e3 * r['exact_s'][b]:.3f} / {1e3 * r['approximate_s'][b]:.3f}"
                 for b in report["batches"]]
        lines.append(f"| {r['size']:,} | " + " | ".join(cells)
                     + f" | {r['recall']:.3f} | {r['build_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    sizes = [r["size"] for r in report["rows"]]
    with figure(path, (7.5, 4.5)) as ax:
        for b in report["batches"]:
            line = ax.plot(sizes, [1e3 * r["exact_s"][b] for r in report["rows"]], "o-",
                           label=f"exact, batch {b}")[0]
            ax.plot(sizes, [1e3 * r["approximate_s"][b] for r in report["rows"]], "s--",
                    color=line.get_color(), label=f"{report['index']}, batch {b}")
        ax.set(xscale="log", yscale="log", xlabel="catalog rows", ylabel="ms per query",
               title=f"top-{report['k']} search cost as the catalog grows")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--sizes", type=positive_list, default=SIZES)
    served = Settings()  # R4T_INDEX and R4T_FAISS_THREADS, as the service would read them
    parser.add_argument("--index", default=served.index, help="the approximate choice")
    parser.add_argument("--threads", type=int, default=served.faiss_threads,
                        help="FAISS threads per search")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args()
    try:
        report = run(args.bundle, args.sizes, args.index, args.threads)
    except R4TError as exc:  # a missing or refused bundle, a bad --index
        parser.error(str(exc))
    publish(args.out, "scale", report, markdown(report))
    plot(report, args.out / "scale.png")


if __name__ == "__main__":
    main()
