"""Session fixtures: a small real bundle from a slice of WordNet (real encoder, real FAISS)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from training.data.splits import wordnet_queries
from training.data.wordnet import load_nouns
from training.pipeline import CatalogConfig, build_catalog

N_QUERIES = 12
N_DISTRACTORS = 1500


@pytest.fixture(scope="session")
def wordnet_synsets():
    return load_nouns()


@pytest.fixture(scope="session")
def small_sources(tmp_path_factory: pytest.TempPathFactory, wordnet_synsets) -> tuple[Path, Path]:
    """A JSONL catalog (a dozen broad queries' subtrees plus distractors) and its benchmark."""
    directory = tmp_path_factory.mktemp("sources")
    queries = wordnet_queries(wordnet_synsets)
    picked = [queries[i] for i in np.random.default_rng(1).choice(len(queries), N_QUERIES, False)]
    keep = {q.id for q in picked} | {item for q in picked for item in q.reference}
    others = sorted(set(wordnet_synsets) - keep)
    keep |= set(np.random.default_rng(2).choice(others, N_DISTRACTORS, replace=False))
    catalog = directory / "catalog.jsonl"
    with catalog.open("w") as out:
        for offset in sorted(keep):
            synset = wordnet_synsets[offset]
            record = {"id": offset, "text": synset.text(), "lemma": synset.lemmas[0]}
            out.write(json.dumps(record) + "\n")
    benchmark = directory / "benchmark.jsonl"
    benchmark.write_text("".join(q.to_json() + "\n" for q in picked))
    return catalog, benchmark


@pytest.fixture(scope="session")
def small_bundle_dir(tmp_path_factory: pytest.TempPathFactory, small_sources) -> Path:
    catalog, benchmark = small_sources
    bundle_dir = tmp_path_factory.mktemp("bundles") / "small"
    build_catalog(bundle_dir, CatalogConfig(source=str(catalog), benchmark=str(benchmark)))
    return bundle_dir
