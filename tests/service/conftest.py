"""Service test fixtures: a small real serving bundle (its parts in bundles.py), a stand-in
completion server (completion.py) and live uvicorn servers on 127.0.0.1 (live.py).

The serving bundle is the session's small WordNet bundle (tests/conftest.py) plus a real
`diffusion/` stage exported by `r4t export diffusion`'s code from a tiny denoiser trained for a
few steps, shaped as the `standalone` student's (the route serves with no ranker). Only the
bundles whose sampler misbehaves on purpose carry a hand-built toy graph (`sampler_graph`).
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from service.artifacts.bundle import read_manifest, write_manifest
from service.settings import Settings
from tests.service.bundles import (
    CONTEXT,
    CONTEXT_SOURCE,
    DRAWS,
    LLM_CONTEXT,
    LLM_K,
    ROWS,
    add_diffusion_stage,
    export_tiny_diffusion,
)
from tests.service.completion import CompletionServer, CompletionServerState, _CompletionHandler
from tests.service.live import LiveServer, live_server, make_settings
from training.data.splits import BenchmarkQuery


@pytest.fixture(scope="session")
def serving_bundle(small_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small real catalog plus a real tiny diffusion export (see the module docstring);
    named "svc". The training run lives outside the bundle, so copies of it stay small."""
    root = tmp_path_factory.mktemp("serving")
    target = root / "svc"
    shutil.copytree(small_bundle_dir, target)
    manifest = read_manifest(target)
    manifest["name"] = target.name
    write_manifest(target, manifest)
    config = export_tiny_diffusion(target, root / "run")
    assert (config["rows"], config["context"], config["context_source"], config["draws"],
            config["claims"]) == (ROWS, CONTEXT, CONTEXT_SOURCE, DRAWS, "pointers")
    return target


@pytest.fixture(scope="session")
def broken_bundle(small_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy sampler graph, built to load and then fail on every run (warm-up drops it): a
    real export cannot be made to misbehave this way."""
    target = tmp_path_factory.mktemp("serving") / "broken"
    shutil.copytree(small_bundle_dir, target)
    add_diffusion_stage(target, broken=True)
    return target


@pytest.fixture(scope="session")
def fragile_bundle(small_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy sampler graph, built to work on batches of up to 2 queries and fail on larger
    ones: a run-time failure a real export cannot be made to have."""
    target = tmp_path_factory.mktemp("serving") / "fragile"
    shutil.copytree(small_bundle_dir, target)
    add_diffusion_stage(target, fail_above=2)
    return target


@pytest.fixture(scope="session")
def benchmark_queries(small_sources: tuple[Path, Path]) -> list[BenchmarkQuery]:
    _, benchmark = small_sources
    queries = []
    for line in benchmark.read_text().splitlines():
        record = json.loads(line)
        queries.append(BenchmarkQuery(record["query"], record["groups"], record.get("id")))
    return queries


@pytest.fixture(scope="session")
def completion_server(
    benchmark_queries: list[BenchmarkQuery], wordnet_synsets: dict
) -> Iterator[CompletionServer]:
    """An OpenAI-compatible /v1/completions stand-in on loopback (real HTTP).

    For a benchmark query it answers with the first lemmas of ten of the query's direct
    hyponym branches, i.e. a plausible fan-out; for any other query, "<query> 1..10".
    """
    fanouts = {}
    for q in benchmark_queries:
        heads = [g[0] for g in q.groups]
        deeper = [member for g in q.groups for member in g[1:]]
        lemmas = dict.fromkeys(wordnet_synsets[o].lemmas[0] for o in heads + deeper)
        lemmas.pop(q.query, None)
        fanouts[q.query] = list(lemmas)[:10]
    state = CompletionServerState(fanouts=fanouts)
    handler = type("Handler", (_CompletionHandler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield CompletionServer(f"http://127.0.0.1:{server.server_address[1]}/v1", state)
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def settings_for(
    serving_bundle: Path, completion_server: CompletionServer
) -> Callable[..., Settings]:
    def build(bundle: Path | None = None, **overrides: Any) -> Settings:
        return make_settings(bundle or serving_bundle, completion_server, **overrides)

    return build


@pytest.fixture(scope="session")
def server(settings_for: Callable[..., Settings]) -> Iterator[LiveServer]:
    """The main live service: both paths, 50/50 A/B, admin API on."""
    with live_server(settings_for()) as live:
        yield live




@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.gguf_model import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def llm_bundle(small_bundle_dir: Path, tiny_gguf: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small catalog with the tiny GGUF as its AR policy (names mode, 16 hybrid names)."""
    from service.backends.llama import LlamaConfig
    from service.fanout.instruction import MAX_QUESTION_CHARS
    from training.stage1_fanout.gguf import commit_llm

    target = tmp_path_factory.mktemp("llm") / "llm"
    shutil.copytree(small_bundle_dir, target)
    commit_llm(target, tiny_gguf, LlamaConfig(mode="names", k=LLM_K, context=LLM_CONTEXT,
                                              max_new_tokens=LLM_K * MAX_QUESTION_CHARS * 2,
                                              n_ctx=4096))  # random weights: byte-level names
    return target
