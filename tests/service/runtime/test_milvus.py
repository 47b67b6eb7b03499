"""The Milvus backend against a real Milvus Lite engine (tests/conftest.py `milvus_engine`):
the same items as FAISS flat, filters inside the engine, a foreign collection refused, and an
engine that goes down and comes back."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from service.artifacts.bundle import load_bundle, read_manifest
from service.errors import BundleError, IndexUnavailableError
from service.runtime.index import IndexChoice, search
from tests.service.live import live_server, wait_until
from training.data.engine import load_into_milvus


@pytest.fixture(scope="module")
def engine_bundle(serving_bundle: Path, milvus_engine, tmp_path_factory) -> Path:
    """A copy of the serving bundle whose catalog is loaded into collection "svc_copy"."""
    target = tmp_path_factory.mktemp("engine") / "svc"
    shutil.copytree(serving_bundle, target)
    load_into_milvus(target, milvus_engine.uri("svc_copy"))
    return target


def test_the_engine_returns_the_items_faiss_flat_returns(engine_bundle):
    exact = load_bundle(engine_bundle)
    served = load_bundle(engine_bundle, IndexChoice.parse("milvus"))
    queries = exact.items.embeddings[::40]  # (Q, d)
    want_scores, want = search(exact.index, queries, 20)
    got_scores, got = search(served.index, queries, 20)
    assert np.array_equal(got, want)
    np.testing.assert_allclose(got_scores, want_scores, atol=1e-5)
    rows = np.array([3, 0, 17])
    np.testing.assert_allclose(served.index.vectors(rows), exact.items.embeddings[rows])
    assert read_manifest(engine_bundle)["stages"]["milvus"]["collection"] == "svc_copy"


@pytest.mark.parametrize("choice", ["bundle", "HNSW16", "milvus"])
def test_a_filter_is_applied_in_the_index_k_items_when_k_match(engine_bundle, choice):
    bundle = load_bundle(engine_bundle, IndexChoice.parse(choice))
    shelf = {r: m["shelf"] for r, m in enumerate(bundle.items.metadata)}
    queries = bundle.items.embeddings[:3]  # benchmark items: their neighbours are too
    _, rows = search(bundle.index, queries, 10, (("shelf", "str", "distractor"),))
    assert (rows >= 0).all() and {shelf[r] for r in rows.ravel()} == {"distractor"}
    lemma = bundle.items.metadata[5]["lemma"]
    _, rows = search(bundle.index, queries[:1], 10, (("lemma", "str", lemma),))
    found = rows[0][rows[0] >= 0]
    assert len(found) >= 1 and all(bundle.items.metadata[r]["lemma"] == lemma for r in found)


def test_a_collection_that_is_not_the_bundles_is_refused(engine_bundle, small_bundle_dir,
                                                         milvus_engine, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(small_bundle_dir, other)
    manifest = read_manifest(engine_bundle)
    record = manifest["stages"]["milvus"]
    load_into_milvus(other, milvus_engine.uri("foreign"))
    foreign = read_manifest(other)["stages"]["milvus"]
    assert foreign["checksum"] == record["checksum"]  # the same catalog: accepted
    load_bundle(other, IndexChoice.parse("milvus"))
    from service.runtime.milvus import MilvusIndex

    with pytest.raises(BundleError, match="does not match"):
        MilvusIndex(foreign["address"], "foreign", "another-checksum", foreign["rows"],
                    foreign["dim"], 2.0)
    with pytest.raises(BundleError, match="no collection"):
        MilvusIndex(foreign["address"], "absent", record["checksum"], record["rows"],
                    record["dim"], 2.0)


@pytest.mark.parametrize("index", ["bundle", "milvus"])
def test_filters_reach_the_api_and_bad_ones_are_422(engine_bundle, settings_for, index):
    bundle = load_bundle(engine_bundle)
    with live_server(settings_for(engine_bundle, index=index)) as live, \
            live.client() as client:
        for route in ("single", "diffusion", "ar", "hybrid"):
            body = {"query": "dog", "k": 7, "route": route, "filter": {"shelf": "distractor"}}
            answer = client.post("/v1/retrieve", json=body)
            assert answer.status_code == 200, answer.text
            ids = [item["id"] for item in answer.json()["items"]]
            assert len(set(ids)) == 7
            rows = [bundle.items.ids.index(i) for i in ids]
            assert {bundle.items.metadata[r]["shelf"] for r in rows} == {"distractor"}
        lemma = bundle.items.metadata[5]["lemma"]  # fewer match than k: those that do
        matching = {i for i, m in zip(bundle.items.ids, bundle.items.metadata, strict=True)
                    if m["lemma"] == lemma}
        answer = client.post("/v1/retrieve", json={"query": "dog", "k": 10, "route": "single",
                                                   "filter": {"lemma": lemma}})
        assert {item["id"] for item in answer.json()["items"]} == matching
        for bad in ({"colour": "red"}, {"shelf": ["a"]}, {"bad name": 1}):
            answer = client.post("/v1/retrieve", json={"query": "dog", "filter": bad})
            assert answer.status_code == 422, (bad, answer.text)
            assert "filter" in answer.text


def test_engine_down_is_503_and_not_ready_then_it_recovers(engine_bundle, settings_for,
                                                           milvus_engine):
    settings = settings_for(engine_bundle, index="milvus", index_timeout_s=1.0)
    with live_server(settings) as live, live.client() as client:
        assert client.post("/v1/retrieve", json={"query": "dog", "route": "single"}
                           ).status_code == 200
        milvus_engine.stop()
        try:
            ready = client.get("/readyz")
            assert ready.status_code == 503 and "milvus" in ready.json()["reason"]
            for route in ("single", "diffusion"):
                answer = client.post("/v1/retrieve", json={"query": "dog", "route": route})
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["type"] == IndexUnavailableError.__name__
                assert "milvus" in answer.json()["error"]["message"]
        finally:
            milvus_engine.start()
        wait_until(lambda: client.get("/readyz").status_code == 200, "ready again")
        answer = client.post("/v1/retrieve", json={"query": "dog", "route": "diffusion"})
        assert answer.status_code == 200, answer.text


def test_a_bundle_without_a_collection_says_how_to_load_one(small_bundle_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(small_bundle_dir, bare)
    manifest = read_manifest(bare)
    if "milvus" in manifest.get("stages", {}):
        pytest.skip("R4T_INDEX=milvus: the small bundle has a collection")
    with pytest.raises(BundleError, match="r4t index"):
        load_bundle(bare, IndexChoice.parse("milvus"))


def test_a_service_started_while_the_engine_is_down_serves_once_it_is_up(
        engine_bundle, settings_for, milvus_engine):
    settings = settings_for(engine_bundle, index="milvus", index_timeout_s=1.0, watch_s=0.2)
    milvus_engine.stop()
    try:
        with live_server(settings, ready=False) as live, live.client() as client:
            wait_until(lambda: client.get("/readyz").json().get("reason") is not None,
                       "start-up refused")
            assert IndexUnavailableError.__name__ in client.get("/readyz").json()["reason"]
            milvus_engine.start()
            wait_until(lambda: client.get("/readyz").status_code == 200, "ready once up")
            answer = client.post("/v1/retrieve", json={"query": "dog", "route": "single"})
            assert answer.status_code == 200, answer.text
    finally:
        if milvus_engine.process is None or milvus_engine.process.poll() is not None:
            milvus_engine.start()


def test_under_a_filter_the_groundedness_gate_does_not_send_diffusion_to_ar(settings_for):
    with live_server(settings_for(groundedness_threshold=0.999)) as live, \
            live.client() as client:
        body = {"query": "bird", "route": "diffusion", "filter": {"shelf": "distractor"}}
        answer = client.post("/v1/retrieve", json=body).json()
        assert answer["route"] == "diffusion" and not answer["fallback"]["used"]
        plain = client.post("/v1/retrieve", json={"query": "bird", "route": "diffusion"}).json()
        assert plain["fallback"] == {"used": True, "reason": "quality"}  # the gate still holds


def test_the_engine_is_loaded_from_the_catalog_command_only():
    from service.command import build_parser

    parser = build_parser()
    assert parser.parse_args(["catalog", "--index", "milvus://h:1/c"]).index == "milvus://h:1/c"
    with pytest.raises(SystemExit):
        parser.parse_args(["bundle", "--index", "milvus://h:1/c"])


@pytest.mark.parametrize("value", ['say "hi"', "back\\slash", "emoji 😀", "naïve", "it's"])
def test_a_filter_value_of_any_text_is_searched_and_keeps_the_client(engine_bundle, value):
    """Quotes, backslashes, emoji and accents reach Milvus as values, not as expression text:
    no match (no item holds them) is an empty answer, and the shared client stays."""
    bundle = load_bundle(engine_bundle, IndexChoice.parse("milvus"))
    queries = bundle.items.embeddings[:2]
    client = bundle.index.client()
    _, rows = search(bundle.index, queries, 5, (("lemma", "str", value),))
    assert (rows == -1).all() and bundle.index.client() is client
    lemma = bundle.items.metadata[5]["lemma"]
    _, rows = search(bundle.index, queries, 5, (("lemma", "str", lemma),))
    assert 5 in rows and all(bundle.items.metadata[r]["lemma"] == lemma for r in rows[rows >= 0])
