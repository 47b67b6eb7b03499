"""Session fixtures: a small real bundle from a slice of WordNet (real encoder, real FAISS), and
a real Milvus Lite engine (a `milvus_lite server` subprocess) that can be stopped and restarted.
The `needs(...)` mark's hooks (tests/prerequisites.py: skip, or fail under CI=true, a test whose
program or module is missing) are installed here.

With R4T_INDEX=milvus in the environment, the small bundle is also loaded into that engine
(`r4t index`), so every test that serves it through Settings searches Milvus instead of FAISS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.prerequisites import pytest_configure, pytest_runtest_setup  # noqa: F401 (hooks)
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
    distractors = set(np.random.default_rng(2).choice(others, N_DISTRACTORS, replace=False))
    keep |= distractors
    catalog = directory / "catalog.jsonl"
    with catalog.open("w") as out:
        for offset in sorted(keep):
            synset = wordnet_synsets[offset]
            record = {"id": offset, "text": synset.text(), "lemma": synset.lemmas[0],
                      "shelf": "distractor" if offset in distractors else "benchmark"}
            out.write(json.dumps(record) + "\n")
    benchmark = directory / "benchmark.jsonl"
    benchmark.write_text("".join(q.to_json() + "\n" for q in picked))
    return catalog, benchmark


@pytest.fixture(scope="session")
def small_bundle_dir(tmp_path_factory: pytest.TempPathFactory, small_sources,
                     request: pytest.FixtureRequest) -> Path:
    catalog, benchmark = small_sources
    bundle_dir = tmp_path_factory.mktemp("bundles") / "small"
    build_catalog(bundle_dir, CatalogConfig(source=str(catalog), benchmark=str(benchmark)))
    if os.environ.get("R4T_INDEX", "").startswith("milvus"):  # serve from the engine
        from training.data.engine import load_into_milvus

        engine = request.getfixturevalue("milvus_engine")
        load_into_milvus(bundle_dir, engine.uri("small"))
    return bundle_dir


ENGINE_WAIT_S = 60.0  # bound on the engine's start; reached only when something is broken


@dataclass
class MilvusEngine:
    """A Milvus Lite gRPC server on loopback over one data folder, stoppable and restartable
    on the same port (what a pod sees when the engine goes down and comes back)."""

    data_dir: Path
    port: int
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def uri(self, collection: str) -> str:
        return f"milvus://127.0.0.1:{self.port}/{collection}"

    def start(self) -> None:
        from pymilvus import MilvusClient

        from service.runtime.milvus import CLIENT_OPTIONS

        self.process = subprocess.Popen(
            [sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(self.data_dir),
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stop = time.monotonic() + ENGINE_WAIT_S
        while True:
            try:
                client = MilvusClient(uri=self.address, timeout=1.0, **CLIENT_OPTIONS)
                client.list_collections(timeout=1.0)
                client.close()
                return
            except Exception:
                if time.monotonic() > stop or self.process.poll() is not None:
                    raise RuntimeError(f"Milvus Lite did not start on {self.address}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@pytest.fixture(scope="session")
def milvus_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MilvusEngine]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = MilvusEngine(tmp_path_factory.mktemp("milvus"), port)
    engine.start()
    yield engine
    engine.stop()
