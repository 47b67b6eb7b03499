"""Stage 2: the synthesis dataset (shapes, ids resolve), resumption, filter, HTTP backend."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from service.artifacts.bundle import load_bundle
from service.errors import BundleError
from service.fanout.format import format_fanout
from service.runtime.encoder import Encoder
from service.runtime.index import search
from tests.training.stage1_fanout.test_policy import THEMES, make_tiny_bundle, make_tiny_policy
from training.data.splits import query_texts
from training.stage2_synthesis.dataset import load_dataset
from training.stage2_synthesis.synthesis import SynthesisConfig, synthesize, top_fraction

TINY = SynthesisConfig(samples_per_query=6, shard_queries=3, max_new_tokens=12, threads=1,
                       extra_queries=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    bundle = make_tiny_bundle(tmp_path_factory.mktemp("synthesis"))
    return bundle, make_tiny_policy(bundle)


class StandIn(BaseHTTPRequestHandler):
    """An OpenAI-compatible /v1/completions that answers with themed fan-outs."""

    requests: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.requests.append(body)
        rng = np.random.default_rng(body["seed"])
        words = [w for ws in THEMES.values() for w in ws]
        texts = [format_fanout(list(rng.choice(words, 10, replace=False)))
                 for _ in range(body["n"])]
        texts[0] = "only one line"  # a malformed sample: dropped, counted in the ledger
        payload = {"choices": [{"index": i, "text": t} for i, t in enumerate(texts)],
                   "usage": {"completion_tokens": 7 * body["n"]}}
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> str:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def check_dataset(bundle_dir: Path, run_dir: Path) -> None:
    data = load_dataset(run_dir, with_text=True)
    bundle = load_bundle(bundle_dir)
    n, k, d = data.target_emb.shape
    assert (k, d) == (10, bundle.items.embeddings.shape[1])
    assert data.query_emb.shape == (n, d) and data.target_rows.shape == (n, k)
    assert data.query_index.shape == data.reward.shape == (n,)
    assert data.target_emb.dtype == data.query_emb.dtype == np.float32
    np.testing.assert_array_equal(data.target_emb, bundle.items.embeddings[data.target_rows])
    queries = query_texts(bundle_dir, "train")
    assert data.queries == queries
    encoded = Encoder(bundle.encoder_config).encode(queries)
    np.testing.assert_allclose(data.query_emb, encoded[data.query_index], atol=1e-6)
    first = Encoder(bundle.encoder_config).encode(data.subqueries[0])  # ids resolve: top-1
    np.testing.assert_array_equal(search(bundle.index, first, 1)[1][:, 0], data.target_rows[0])
    assert ((data.reward >= 0) & (data.reward <= 1)).all()


def test_local_backend_dataset_and_resume(setup: tuple[Path, Path], tmp_path: Path) -> None:
    bundle, policy = setup
    run = tmp_path / "run"
    synthesize(bundle, TINY, policy, run)
    ledger = json.loads((run / "ledger.json").read_text())
    n_train = len(query_texts(bundle, "train"))
    assert ledger["samples"] == n_train * TINY.samples_per_query
    assert ledger["kept"] + ledger["dropped"] == ledger["samples"] and ledger["tokens"] > 0
    if ledger["kept"]:
        check_dataset(bundle, run)
    assert (run / "policy-onnx" / "model.onnx").is_file()  # sampled by ONNX Runtime
    synthesize(bundle, TINY, policy, run)  # every shard is done: nothing is sampled again
    assert json.loads((run / "ledger.json").read_text()) == ledger
    with pytest.raises(BundleError, match="another config"):
        synthesize(bundle, replace(TINY, temperature=0.5), policy, run)


def test_http_backend_against_a_stand_in(setup: tuple[Path, Path], tmp_path: Path,
                                         server: str) -> None:
    bundle, policy = setup
    StandIn.requests.clear()
    config = replace(TINY, backend="http", endpoint=server)
    synthesize(bundle, config, policy, tmp_path / "http")
    ledger = json.loads((tmp_path / "http" / "ledger.json").read_text())
    n_train = len(query_texts(bundle, "train"))
    assert len(StandIn.requests) == n_train
    assert StandIn.requests[0]["temperature"] == 0.9 and StandIn.requests[0]["n"] == 6
    assert ledger["dropped"] == n_train and ledger["kept"] == n_train * 5
    assert ledger["tokens"] == 7 * 6 * n_train
    check_dataset(bundle, tmp_path / "http")


def test_torch_backend_samples_the_same_policy(setup: tuple[Path, Path], tmp_path: Path) -> None:
    bundle, policy = setup
    config = replace(TINY, backend="torch", samples_per_query=2)
    synthesize(bundle, config, policy, tmp_path / "torch", queries=["camping", "music"])
    ledger = json.loads((tmp_path / "torch" / "ledger.json").read_text())
    assert ledger["samples"] == 4 and ledger["tokens"] > 0


def test_keep_top_fraction_keeps_the_best() -> None:
    reward = np.array([0.1, 0.9, 0.5, 0.7])
    assert top_fraction(reward, None).tolist() == [0, 1, 2, 3]
    assert top_fraction(reward, 0.5).tolist() == [1, 3]


def test_extra_catalog_queries_get_their_own_sample_count(
    setup: tuple[Path, Path], tmp_path: Path, server: str
) -> None:
    bundle, policy = setup
    StandIn.requests.clear()
    config = replace(TINY, backend="http", endpoint=server, extra_queries=3, extra_samples=2)
    synthesize(bundle, config, policy, tmp_path / "extra")
    train = query_texts(bundle, "train")
    held_out = {q.lower() for split in ("val", "test") for q in query_texts(bundle, split)}
    data = load_dataset(tmp_path / "extra")
    assert data.queries[: len(train)] == train and len(data.queries) == len(train) + 3
    extra = data.queries[len(train):]
    assert not {q.lower() for q in extra} & (held_out | {q.lower() for q in train})
    assert [r["n"] for r in StandIn.requests] == [6] * len(train) + [2] * 3
    assert set(data.query_index.tolist()) == set(range(len(train) + 3))


@pytest.mark.parametrize("flags", [["--extra-queries", "-1"], ["--extra-samples", "0"],
                                   ["--samples", "0"], ["--temperature", "-0.5"]])
def test_bad_synthesis_flags_are_a_clear_error(flags: list[str], capsys: pytest.CaptureFixture,
                                               tmp_path: Path) -> None:
    from service.command import main

    assert main(["--bundle", str(tmp_path), "synthesize", *flags]) == 2
    assert "r4t: error: synthesis:" in capsys.readouterr().err
