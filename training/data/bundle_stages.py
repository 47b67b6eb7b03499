"""The bundle's data stages, catalog (parse → embed → FAISS index), lexical (BM25) and
benchmark (broad queries and their splits): beside the data code they commit, away from the
planner that decides when they run (`training.pipeline`)."""

from __future__ import annotations

import importlib.metadata
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from service.artifacts.bundle import CONTENT_KEY, INDEX_FILE, config_hash, sha256_file, stage
from service.artifacts.items import ITEMS_FILE, ItemStore
from service.artifacts.lexical import LEXICAL_FILE, MAX_DF, TOKENIZER, build_lexical_index
from service.artifacts.parts import PARTS_FILE
from service.errors import BundleError
from service.runtime.encoder import ENCODER_FOLDER, MATRYOSHKA_DIMS, Encoder, EncoderConfig
from service.runtime.index import build_index, save_index
from training.data.catalog import WORDNET, Catalog
from training.data.encoder import encoder_source, export_encoder, source_key
from training.data.parts import PART_NAMES, embed_parts
from training.data.splits import (
    SPLIT_RULE,
    read_benchmark_file,
    split_queries,
    wordnet_queries,
    write_splits,
)

EMBED_CHUNK = 4096
LEXICAL_KEY: dict[str, Any] = {"engine": "sqlite-fts5", "tokenize": TOKENIZER, "max_df": MAX_DF}


@dataclass(frozen=True)
class CatalogConfig:
    """What the catalog stage builds: source, encoder and its dimension, index type, split
    seed."""

    source: str = WORDNET  # "wordnet" or a path to a JSONL catalog
    benchmark: str | None = None  # JSONL benchmark for a user's catalog (WordNet derives its own)
    dim: int = 128
    encoder: str = "wordllama"  # or "minilm", or a local checkpoint (training.data.encoder)
    index_factory: str | None = None  # None = exact inner product ("Flat")
    seed: int = 0


def embed_texts(encoder: Encoder, texts: list[str], desc: str = "embed") -> np.ndarray:
    """Encode in chunks with a progress bar: (N, dim) float32 unit rows."""
    out = np.empty((len(texts), encoder.dim), dtype=np.float32)
    with tqdm(total=len(texts), desc=desc, unit="item", unit_scale=True) as bar:
        for start in range(0, len(texts), EMBED_CHUNK):
            chunk = texts[start : start + EMBED_CHUNK]
            out[start : start + len(chunk)] = encoder.encode(chunk)
            bar.update(len(chunk))
    return out


def catalog_stage(
    bundle_dir: Path, manifest: dict, config: CatalogConfig, catalog: Catalog,
    key: dict[str, Any],
) -> None:
    """Embed the catalog, build the index, commit items + embeddings + index."""
    started = time.perf_counter()
    record: dict[str, Any] = {}
    with stage(bundle_dir, manifest, "catalog", record) as staged:
        encoder = catalog_encoder(config, staged)
        served = Encoder(encoder)
        embeddings = embed_texts(served, catalog.texts)  # (M, d)
        with tqdm(total=1, desc=f"index ({config.index_factory or 'Flat'})") as bar:
            index = build_index(embeddings, config.index_factory)
            save_index(index, staged / INDEX_FILE)
            bar.update(1)
        store = ItemStore(catalog.ids, catalog.texts, embeddings, catalog.metadata)
        np.save(staged / PARTS_FILE, embed_parts(
            catalog.texts, encoder.dim, lambda texts, desc: embed_texts(served, texts, desc)))
        exported = sorted(p.relative_to(staged).as_posix()
                          for p in (staged / ENCODER_FOLDER).glob("*"))  # none for WordLlama
        files = [*store.save(staged), INDEX_FILE, PARTS_FILE, *exported]
        record.update(stage_record(key, started, n_items=len(catalog)),  # the plan's key
                      files=files)
        record[CONTENT_KEY] = {ITEMS_FILE: sha256_file(staged / ITEMS_FILE),
                               "encoder": encoder_content(encoder)}
        manifest["n_items"] = len(catalog)
        manifest["config"] = asdict(config)
        manifest["encoder"] = {"name": encoder.name, "dim": encoder.dim}
        manifest["parts"] = list(PART_NAMES)  # the columns of PARTS_FILE
        if encoder.folder is not None:
            manifest["encoder"]["folder"] = ENCODER_FOLDER


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
    record: dict[str, Any] = {}
    with stage(bundle_dir, manifest, "benchmark", record) as staged:
        splits = split_queries(queries, config.seed)
        files = write_splits(splits, staged)
        counts = {name: len(qs) for name, qs in splits.items()}
        record.update(stage_record(benchmark_key(config), started, n_queries=counts),
                      files=files)


def lexical_stage(bundle_dir: Path, manifest: dict, texts: list[str]) -> None:
    """Index the item texts for BM25 search (service.artifacts.lexical)."""
    started = time.perf_counter()
    record: dict[str, Any] = {}
    with stage(bundle_dir, manifest, "lexical", record) as staged, \
            tqdm(total=1, desc="lexical index (FTS5)") as bar:
        build_lexical_index(staged / LEXICAL_FILE, texts)
        bar.update(1)
        record.update(stage_record(LEXICAL_KEY, started, n_items=len(texts)),
                      files=[LEXICAL_FILE])
        record[CONTENT_KEY] = {}  # a function of its config and the catalog's texts


def check_encoder_dim(config: CatalogConfig) -> None:
    """WordLlama cuts to a Matryoshka dimension; a transformer gives its own width."""
    source_dim = encoder_source(config.encoder).dim
    if source_dim is None and config.dim not in MATRYOSHKA_DIMS:
        raise BundleError(f"--dim {config.dim}: WordLlama's dimensions are {MATRYOSHKA_DIMS}")
    if source_dim is not None and source_dim != config.dim:
        raise BundleError(f"--encoder {config.encoder} gives {source_dim}-d vectors, not "
                          f"--dim {config.dim}")


def catalog_encoder(config: CatalogConfig, staged: Path) -> EncoderConfig:
    """The encoder the catalog is embedded with: WordLlama, or `config.encoder` exported to
    ONNX into the staged bundle's encoder folder (what the service will run)."""
    source = encoder_source(config.encoder)
    if source.folder is None:
        return EncoderConfig(dim=config.dim)
    return export_encoder(source, staged / ENCODER_FOLDER)


def encoder_content(encoder: EncoderConfig) -> dict[str, Any]:
    """What the catalog's vectors are a function of besides its texts: the encoder's name,
    width and, for WordLlama, its package version (its weights ship in the wheel)."""
    content: dict[str, Any] = {"name": encoder.name, "dim": encoder.dim}
    if encoder.folder is None:
        content["version"] = importlib.metadata.version("wordllama")
    return content


def catalog_key(config: CatalogConfig) -> dict[str, Any]:
    """The catalog stage's config: what its vectors and index are a function of."""
    key: dict[str, Any] = {"source": config.source, "dim": config.dim}
    key["index_factory"], key["parts"] = config.index_factory, list(PART_NAMES)
    if config.encoder != CatalogConfig.encoder:  # a WordLlama bundle keeps its earlier key
        key["encoder"] = source_key(encoder_source(config.encoder))
    if config.source != WORDNET and Path(config.source).is_file():
        key["source_sha256"] = sha256_file(Path(config.source))
    return key


def benchmark_key(config: CatalogConfig) -> dict[str, Any]:
    """The benchmark stage's config: its source, file, split seed and split rule (a bundle
    split by query before texts shared a split rebuilds)."""
    key: dict[str, Any] = {"source": config.source, "benchmark": config.benchmark}
    key["seed"], key["split"] = config.seed, SPLIT_RULE
    if config.benchmark and Path(config.benchmark).is_file():
        key["benchmark_sha256"] = sha256_file(Path(config.benchmark))
    return key


def stage_record(key: dict[str, Any], started: float, **extra: Any) -> dict[str, Any]:
    """A data stage's record: its key and hash, as the plan compares them, and its time."""
    return {
        "config": key,
        "config_hash": config_hash(key),
        "wall_s": round(time.perf_counter() - started, 2),
        **extra,
    }
