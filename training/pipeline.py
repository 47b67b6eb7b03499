"""Builds a bundle stage by stage, skipping every stage whose recorded config is current.

Stages so far: `catalog` (parse → embed → FAISS index) and `benchmark` (broad queries and
their splits). Each stage writes into a staging folder inside the bundle and is committed
by `service.bundle.commit_stage`, so a failed stage leaves the bundle as it was.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from service.bundle import (
    INDEX_FILE,
    commit_stage,
    config_hash,
    new_manifest,
    read_manifest,
    sha256_file,
    stage_is_current,
)
from service.encoder import Encoder, EncoderConfig
from service.errors import BundleError
from service.index import build_index, save_index
from service.items import ItemStore
from training.benchmark import read_benchmark_file, split_queries, wordnet_queries, write_splits
from training.catalog import WORDNET, Catalog, load_catalog

MODELS_DIR = Path("models")
EMBED_CHUNK = 4096


@dataclass(frozen=True)
class CatalogConfig:
    """What the catalog stage builds: source, encoder dimension, index type, split seed."""

    source: str = WORDNET  # "wordnet" or a path to a JSONL catalog
    benchmark: str | None = None  # JSONL benchmark for a user's catalog (WordNet derives its own)
    dim: int = 128
    index_factory: str | None = None  # None = exact inner product ("Flat")
    seed: int = 0


CATALOG_PRESETS: dict[str, CatalogConfig] = {"default": CatalogConfig()}


def embed_texts(encoder: Encoder, texts: list[str], desc: str = "embed") -> np.ndarray:
    """Encode in chunks with a progress bar: (N, dim) float32 unit rows."""
    out = np.empty((len(texts), encoder.dim), dtype=np.float32)
    with tqdm(total=len(texts), desc=desc, unit="item", unit_scale=True) as bar:
        for start in range(0, len(texts), EMBED_CHUNK):
            chunk = texts[start : start + EMBED_CHUNK]
            out[start : start + len(chunk)] = encoder.encode(chunk)
            bar.update(len(chunk))
    return out


def open_bundle(bundle_dir: Path, config: CatalogConfig) -> dict[str, Any]:
    """The bundle's manifest, or a fresh one; refuse to mix encoders in one bundle."""
    bundle_dir.mkdir(parents=True, exist_ok=True)
    try:
        manifest = read_manifest(bundle_dir)
    except BundleError:
        return new_manifest(bundle_dir.name, EncoderConfig(dim=config.dim), config.seed)
    if manifest["encoder"]["dim"] != config.dim:
        raise BundleError(
            f"{bundle_dir} was built with dim {manifest['encoder']['dim']}, not {config.dim}; "
            "use another bundle name"
        )
    return manifest


def catalog_stage(
    bundle_dir: Path, manifest: dict, config: CatalogConfig, catalog: Catalog
) -> None:
    """Embed the catalog, build the index, commit items + embeddings + index."""
    started = time.perf_counter()
    staged = Path(tempfile.mkdtemp(prefix=".staging-catalog-", dir=bundle_dir))
    try:
        embeddings = embed_texts(Encoder(EncoderConfig(dim=config.dim)), catalog.texts)
        with tqdm(total=1, desc=f"index ({config.index_factory or 'Flat'})") as bar:
            index = build_index(embeddings, config.index_factory)
            save_index(index, staged / INDEX_FILE)
            bar.update(1)
        store = ItemStore(catalog.ids, catalog.texts, embeddings, catalog.metadata)
        files = [*store.save(staged), INDEX_FILE]
        manifest["n_items"] = len(catalog)
        manifest["config"] = asdict(config)
        record = _stage_record(_catalog_key(config), started, n_items=len(catalog))
        commit_stage(bundle_dir, manifest, "catalog", staged, files, record)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def benchmark_stage(
    bundle_dir: Path, manifest: dict, config: CatalogConfig, catalog: Catalog
) -> None:
    """Derive (WordNet) or read (user file) the benchmark, split it, commit the splits."""
    started = time.perf_counter()
    if config.source == WORDNET:
        queries = wordnet_queries()
    elif config.benchmark:
        queries = read_benchmark_file(Path(config.benchmark), set(catalog.ids))
    else:
        return
    staged = Path(tempfile.mkdtemp(prefix=".staging-benchmark-", dir=bundle_dir))
    try:
        splits = split_queries(queries, config.seed)
        files = write_splits(splits, staged)
        counts = {name: len(qs) for name, qs in splits.items()}
        record = _stage_record(_benchmark_key(config), started, n_queries=counts)
        commit_stage(bundle_dir, manifest, "benchmark", staged, files, record)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def build_catalog(bundle_dir: Path, config: CatalogConfig, force: bool = False) -> dict[str, Any]:
    """Run the catalog and benchmark stages that are not current; return the manifest."""
    catalog_current = stage_is_current(_existing(bundle_dir), "catalog", _catalog_key(config))
    bench_current = stage_is_current(_existing(bundle_dir), "benchmark", _benchmark_key(config))
    if catalog_current and bench_current and not force:
        print(f"{bundle_dir}: catalog and benchmark are up to date")
        return read_manifest(bundle_dir)
    catalog = load_catalog(config.source, config.index_factory)  # validates before any write
    manifest = open_bundle(bundle_dir, config)
    if force or not catalog_current:
        catalog_stage(bundle_dir, manifest, config, catalog)
    if force or not bench_current:
        benchmark_stage(bundle_dir, manifest, config, catalog)
    stages = manifest["stages"]
    summary = {k: stages[k] for k in ("catalog", "benchmark") if k in stages}
    print(json.dumps(summary, indent=2))
    return manifest


def _existing(bundle_dir: Path) -> dict[str, Any]:
    try:
        return read_manifest(bundle_dir)
    except BundleError:
        return {}


def _catalog_key(config: CatalogConfig) -> dict[str, Any]:
    key: dict[str, Any] = {"source": config.source, "dim": config.dim}
    key["index_factory"] = config.index_factory
    if config.source != WORDNET and Path(config.source).is_file():
        key["source_sha256"] = sha256_file(Path(config.source))
    return key


def _benchmark_key(config: CatalogConfig) -> dict[str, Any]:
    key: dict[str, Any] = {"source": config.source, "benchmark": config.benchmark}
    key["seed"] = config.seed
    if config.benchmark and Path(config.benchmark).is_file():
        key["benchmark_sha256"] = sha256_file(Path(config.benchmark))
    return key


def _stage_record(key: dict[str, Any], started: float, **extra: Any) -> dict[str, Any]:
    return {
        "config": key,
        "config_hash": config_hash(key),
        "wall_s": round(time.perf_counter() - started, 2),
        **extra,
    }
