"""A bundle still being built: the `single` route from the catalog alone, and a watched bundle
switching routes by itself, with no failed request, as a stage lands."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.service.bundles import add_diffusion_stage
from tests.service.live import live_server, wait_until
from tests.service.scrape import assert_k_unique


@pytest.fixture
def catalog_only(small_bundle_dir: Path, tmp_path: Path) -> Path:
    """What `r4t bundle` has written after its first stage: catalog, index, benchmark."""
    target = tmp_path / "building"
    shutil.copytree(small_bundle_dir, target)
    return target


def test_a_catalog_alone_serves_the_ranked_and_single_routes(settings_for, catalog_only):
    settings = settings_for(bundle=catalog_only, openai_base_url=None)
    with live_server(settings) as live, live.client() as client:
        ready = client.get("/readyz").json()
        assert ready["routes"] == ["ranked", "hybrid", "single"]  # the ranker is a catalog stage
        ranked = client.post("/v1/retrieve", json={"query": "fish", "k": 7}).json()
        assert_k_unique(ranked, 7)
        assert ranked["route"] == "ranked"  # no configured arm loaded: the best loaded route
        assert ranked["fallback"]["used"] is False and ranked["groundedness"] == 1.0
        body = client.post("/v1/retrieve", json={"query": "fish", "k": 7,
                                                 "route": "single"}).json()
        assert_k_unique(body, 7)
        assert body["route"] == "single" and body["fallback"]["used"] is False
        assert {item["slot"] for item in body["items"]} == {0}  # one probe: the query
        scores = [item["score"] for item in body["items"]]
        assert scores == sorted(scores, reverse=True)  # nearest first
        forced = client.post("/v1/retrieve", json={"query": "fish", "route": "diffusion"})
        assert forced.json()["route"] == "single"  # the last resort of a diffusion request
        assert forced.json()["fallback"] == {"used": True, "reason": "unavailable"}
        missing = client.post("/v1/retrieve", json={"query": "fish", "route": "ar"})
        assert missing.status_code == 503 and "ar route is unavailable" in missing.text


def test_a_watched_bundle_switches_to_diffusion_when_its_stage_lands(settings_for, catalog_only):
    settings = settings_for(bundle=catalog_only, openai_base_url=None, watch_s=0.05,
                            routes="diffusion=1")
    statuses: list[int] = []
    routes: list[str] = []
    stop = threading.Event()

    def hammer(url: str) -> None:
        with httpx.Client(base_url=url, timeout=30.0) as client:
            while not stop.is_set():
                response = client.post("/v1/retrieve", json={"query": "tree", "k": 5})
                statuses.append(response.status_code)
                if response.status_code == 200:
                    routes.append(response.json()["route"])

    with live_server(settings) as live, live.client() as client:
        assert client.get("/readyz").json()["routes"] == ["ranked", "hybrid", "single"]
        worker = threading.Thread(target=hammer, args=(live.url,))
        worker.start()
        try:
            deadline = time.monotonic() + 60
            while not routes:  # answered from the catalog alone first
                assert time.monotonic() < deadline and set(statuses) <= {200}
                time.sleep(0.01)
            add_diffusion_stage(catalog_only)  # the build commits stage 3
            while "diffusion" not in client.get("/readyz").json()["routes"]:
                assert time.monotonic() < deadline, client.get("/v1/info").json()["reload"]
                time.sleep(0.05)
            served = len(routes)
            while len(routes) < served + 5:  # a few answers after the swap
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            stop.set()
            worker.join(timeout=30)
        assert set(statuses) == {200}  # nothing failed while the bundle was swapped
        assert routes[0] == "ranked" and routes[-1] == "diffusion"
        assert client.get("/v1/info").json()["reload"]["state"] == "succeeded"


def test_a_watched_reload_that_fails_is_retried_until_the_stage_loads(settings_for,
                                                                      catalog_only, tmp_path):
    """A stage lands before its sampler file is in place (a transient fault): the reload is
    refused, retried with backoff, and diffusion serves once the file is there, with no
    further change to the manifest (issue 41, item 7)."""
    staged = tmp_path / "staging" / catalog_only.name
    shutil.copytree(catalog_only, staged)
    add_diffusion_stage(staged)
    settings = settings_for(bundle=catalog_only, openai_base_url=None, watch_s=0.05,
                            routes="diffusion=1")
    with live_server(settings) as live, live.client() as client:
        assert "diffusion" not in client.get("/readyz").json()["routes"]
        shutil.copytree(staged / "diffusion", catalog_only / "diffusion",
                        ignore=shutil.ignore_patterns("sampler.onnx"))
        shutil.copyfile(staged / "manifest.json", catalog_only / "manifest.tmp")
        os.replace(catalog_only / "manifest.tmp", catalog_only / "manifest.json")  # it lands
        wait_until(lambda: client.get("/v1/info").json()["reload"]["state"] == "failed",
                   "the reload of a stage without its sampler refused")
        shutil.copyfile(staged / "diffusion" / "sampler.onnx",
                        catalog_only / "diffusion" / "sampler.onnx")
        wait_until(lambda: "diffusion" in client.get("/readyz").json()["routes"],
                   "the failed reload retried")
        assert client.get("/v1/info").json()["reload"]["state"] == "succeeded"
        body = client.post("/v1/retrieve", json={"query": "tree", "route": "diffusion"}).json()
        assert body["route"] == "diffusion" and body["fallback"]["used"] is False
