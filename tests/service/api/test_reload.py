"""POST /admin/reload: bearer auth, atomic swap, and refusal of a corrupted bundle."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from service.artifacts.bundle import read_manifest, write_manifest
from service.loopback import free_port
from tests.service.completion import asked
from tests.service.live import ADMIN_TOKEN, live_server
from tests.service.scrape import assert_k_unique, metric_samples

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def reload_server(settings_for, tmp_path_factory):
    """The service, reloading bundles from anywhere in this run's temporary folders."""
    with live_server(settings_for(models_root=tmp_path_factory.getbasetemp())) as live:
        yield live


@pytest.fixture
def corrupted_bundle(serving_bundle: Path, tmp_path: Path) -> Path:
    target = tmp_path / "corrupted"
    shutil.copytree(serving_bundle, target)
    with (target / "embeddings.npy").open("r+b") as handle:  # flip bytes inside the data
        handle.seek(-64, 2)
        handle.write(b"\x00" * 64)
    return target


@pytest.fixture
def second_bundle(serving_bundle: Path, tmp_path: Path) -> Path:
    target = tmp_path / "second"
    shutil.copytree(serving_bundle, target)
    manifest = read_manifest(target)
    manifest["name"] = "second"
    write_manifest(target, manifest)
    return target


@pytest.mark.parametrize("headers, status", [
    ({}, 401),
    ({"Authorization": "Basic abc"}, 401),
    ({"Authorization": "Bearer wrong"}, 403),
])
def test_reload_needs_the_admin_token(reload_server, headers, status):
    with reload_server.client() as client:
        assert client.post("/admin/reload", headers=headers).status_code == status
        assert client.get("/admin/reload", headers=headers).status_code == status


def test_admin_api_is_off_without_a_token(settings_for):
    with live_server(settings_for(admin_token=None)) as live, live.client() as client:
        response = client.post("/admin/reload", headers=AUTH)
        assert response.status_code == 403
        assert "disabled" in response.json()["error"]["message"]


def test_corrupted_bundle_is_refused_and_the_old_one_keeps_serving(
    reload_server, corrupted_bundle, serving_bundle
):
    with reload_server.client() as client:
        response = client.post("/admin/reload", headers=AUTH,
                               json={"bundle": str(corrupted_bundle), "wait": True})
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["type"] == "BundleError" and "sha256" in error["message"]
        status = client.get("/admin/reload", headers=AUTH).json()
        assert status["state"] == "failed" and "sha256" in status["error"]
        served = client.get("/v1/info").json()["served"]["bundle"]["path"]
        assert served == str(serving_bundle)
        answer = client.post("/v1/retrieve", json={"query": "dog"})
        assert answer.status_code == 200 and answer.json()["bundle"] == "svc"
        reloads = metric_samples(client.get("/metrics").text, "r4t_reloads_total")
        assert any(s.labels["outcome"] == "failed" and s.value >= 1 for s in reloads)


def test_background_reload_swaps_while_serving(reload_server, second_bundle):
    with reload_server.client() as client:
        response = client.post("/admin/reload", headers=AUTH, json={"bundle": str(second_bundle)})
        assert response.status_code == 202 and response.json()["state"] == "loading"
        codes = []
        for _ in range(400):  # keep asking while the new bundle loads and warms up
            codes.append(client.post("/v1/retrieve", json={"query": "cat"}).status_code)
            state = client.get("/admin/reload", headers=AUTH).json()["state"]
            if state != "loading":
                break
            time.sleep(0.02)
        assert state == "succeeded"
        assert set(codes) == {200}
        assert client.get("/v1/info").json()["served"]["bundle"]["path"] == str(second_bundle)
        answer = client.post("/v1/retrieve", json={"query": "cat"}).json()
        assert answer["bundle"] == "second"
        assert_k_unique(answer, 10)


@pytest.fixture
def unloadable_bundle(serving_bundle: Path, tmp_path: Path) -> Path:
    """A bundle that passes its checksums but whose sampler ONNX Runtime cannot load (as an
    opset or runtime mismatch would leave it)."""
    from service.artifacts.bundle import sha256_file

    target = tmp_path / "unloadable"
    shutil.copytree(serving_bundle, target)
    sampler = target / "diffusion" / "sampler.onnx"
    sampler.write_bytes(b"not an onnx graph" * 64)
    manifest = read_manifest(target)
    manifest["name"] = "unloadable"
    manifest["files"]["diffusion/sampler.onnx"] = {"sha256": sha256_file(sampler),
                                                   "bytes": sampler.stat().st_size}
    write_manifest(target, manifest)
    return target


def test_a_bundle_whose_model_does_not_load_is_refused_and_the_old_one_keeps_serving(
    reload_server, unloadable_bundle
):
    with reload_server.client() as client:
        before = client.get("/v1/info").json()["served"]["bundle"]
        response = client.post("/admin/reload", headers=AUTH,
                               json={"bundle": str(unloadable_bundle), "wait": True})
        assert response.status_code == 422, response.text
        assert "diffusion route's model does not load" in response.json()["error"]["message"]
        assert client.get("/v1/info").json()["served"]["bundle"] == before
        answer = client.post("/v1/retrieve", json={"query": "dog", "route": "diffusion"})
        assert answer.status_code == 200
        assert answer.json()["route"] == "diffusion" and not answer.json()["fallback"]["used"]


def test_a_reload_replays_recent_queries_through_the_new_bundle(
        reload_server, second_bundle, completion_server):
    """The new bundle's paths answer the queries the old one served last before it is
    swapped in, so traffic meets warm caches and estimates rather than a cold start."""
    with reload_server.client() as client:
        query = "replayed reload probe"
        assert client.post("/v1/retrieve", json={"query": query, "route": "ar"}
                           ).status_code == 200
        assert asked(completion_server, query) == 1
        response = client.post("/admin/reload", headers=AUTH,
                               json={"bundle": str(second_bundle), "wait": True})
        assert response.status_code == 200 and response.json()["state"] == "succeeded"
        assert asked(completion_server, query) == 2  # replayed by the new AR path's warm-up


@pytest.fixture
def rankerless_bundle(serving_bundle: Path, tmp_path: Path) -> Path:
    """A bundle whose checksums pass but which has no ranker stage (as a partial copy leaves
    it): the ranked route the served bundle has cannot load."""
    target = tmp_path / "rankerless"
    shutil.copytree(serving_bundle, target)
    shutil.rmtree(target / "ranker")
    manifest = read_manifest(target)
    manifest["name"] = "rankerless"
    manifest["files"] = {f: v for f, v in manifest["files"].items() if not f.startswith("ranker/")}
    manifest["stages"].pop("ranker", None)
    write_manifest(target, manifest)
    return target


def test_a_reload_that_would_lose_a_served_route_is_refused(reload_server, rankerless_bundle):
    with reload_server.client() as client:
        before = client.get("/v1/info").json()["served"]["bundle"]
        assert "ranked" in client.get("/readyz").json()["routes"]
        response = client.post("/admin/reload", headers=AUTH,
                               json={"bundle": str(rankerless_bundle), "wait": True})
        assert response.status_code == 422, response.text
        assert "lacks routes the service serves (ranked" in response.json()["error"]["message"]
        assert client.get("/v1/info").json()["served"]["bundle"] == before
        answer = client.post("/v1/retrieve", json={"query": "dog", "route": "ranked"})
        assert answer.status_code == 200 and answer.json()["route"] == "ranked"


def test_a_reload_replays_answered_queries_only(reload_server, second_bundle, completion_server):
    """A refused request is not replayed into the next bundle's warm-up."""
    with reload_server.client() as client:
        refused = "refused replay probe"  # a filter on no field: the retriever's 422
        assert client.post("/v1/retrieve", json={"query": refused, "filter": {"nofield": 1}}
                           ).status_code == 422
        assert refused not in reload_server.app.state.r4t.retriever.recent
        answered = "answered replay probe"
        assert client.post("/v1/retrieve", json={"query": answered}).status_code == 200
        assert reload_server.app.state.r4t.retriever.recent[-1] == answered


def test_a_reload_outside_the_models_root_is_refused(settings_for, serving_bundle, tmp_path):
    """The admin API loads bundles from one folder (R4T_MODELS_ROOT, default: the start-up
    bundle's parent): a path out of it is the caller's 422, and nothing is loaded."""
    outside = tmp_path / "elsewhere"
    shutil.copytree(serving_bundle, outside)
    with live_server(settings_for()) as live, live.client() as client:
        for bundle in (str(outside), "../elsewhere", "/etc"):
            response = client.post("/admin/reload", headers=AUTH,
                                   json={"bundle": bundle, "wait": True})
            assert response.status_code == 422 and "models root" in response.text, bundle
        assert client.get("/admin/reload", headers=AUTH).json()["state"] == "idle"
        response = client.post("/admin/reload", headers=AUTH,  # by name, under the root
                               json={"bundle": serving_bundle.name, "wait": True})
        assert response.status_code == 200, response.text


def test_anonymous_info_holds_no_credentials_and_no_reload_details(settings_for):
    # the key holds no hex word: /v1/info lists sha256 checksums, where "abc" can occur
    secret = "http://user:s3cret@127.0.0.1:9/v1?api_key=key-zq"
    with live_server(settings_for(openai_base_url=secret)) as live, live.client() as client:
        info = client.get("/v1/info").json()
        assert "s3cret" not in json.dumps(info) and "key-zq" not in json.dumps(info)
        assert info["settings"]["openai_base_url"] == "http://127.0.0.1:9/v1"
        assert info["reload"] == {"state": "idle"}


def test_with_an_admin_port_the_admin_api_exists_there_only(settings_for):
    admin_port = free_port()
    with live_server(settings_for(admin_port=admin_port)) as live, live.client() as client:
        assert client.post("/admin/reload", headers=AUTH).status_code == 404
        assert client.get("/admin/reload", headers=AUTH).status_code == 404
        assert client.post("/v1/retrieve", json={"query": "dog"}).status_code == 200
        admin = f"http://127.0.0.1:{admin_port}"
        assert httpx.get(f"{admin}/admin/reload").status_code == 401
        assert httpx.get(f"{admin}/admin/reload", headers=AUTH).json()["state"] == "idle"


def test_a_reload_whose_ranker_passes_its_checksum_but_does_not_load_is_refused(
        reload_server, serving_bundle, tmp_path):
    """A ranker stage of another service version (features it does not compute), checksummed:
    the ranked route cannot load, and the served one is kept."""
    from service.artifacts.bundle import sha256_file

    target = tmp_path / "foreign-ranker"
    shutil.copytree(serving_bundle, target)
    config_path = target / "ranker" / "ranker.json"
    config = json.loads(config_path.read_text())
    config["features"] = ["a_feature_this_service_does_not_compute"]
    config_path.write_text(json.dumps(config))
    manifest = read_manifest(target)
    manifest["files"]["ranker/ranker.json"] = {"sha256": sha256_file(config_path),
                                               "bytes": config_path.stat().st_size}
    write_manifest(target, manifest)
    with reload_server.client() as client:
        before = client.get("/v1/info").json()["served"]["bundle"]
        response = client.post("/admin/reload", headers=AUTH,
                               json={"bundle": str(target), "wait": True})
        assert response.status_code == 422 and "ranked" in response.json()["error"]["message"]
        assert client.get("/v1/info").json()["served"]["bundle"] == before
