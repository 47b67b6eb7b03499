"""The diffusion route stands alone: its context is the query's nearest items and their mention
features (service.ranker.mention_context), so it serves from a bundle without the ranker's
files."""

from __future__ import annotations

import shutil
from pathlib import Path

from service.artifacts.bundle import read_manifest, write_manifest
from service.ranker.ranker import RANKER_DIR
from tests.service.live import live_server


def without_ranker(bundle: Path, target: Path) -> Path:
    shutil.copytree(bundle, target)
    manifest = read_manifest(target)
    manifest["stages"].pop("ranker", None)
    manifest["files"] = {name: record for name, record in manifest["files"].items()
                         if not name.startswith(f"{RANKER_DIR}/")}
    write_manifest(target, manifest)
    shutil.rmtree(target / RANKER_DIR)
    return target


def test_diffusion_serves_with_the_ranker_s_files_absent(serving_bundle, settings_for,
                                                        tmp_path):
    assert (serving_bundle / RANKER_DIR).is_dir()  # the copy below lacks what this holds
    bundle = without_ranker(serving_bundle, tmp_path / "no-ranker")
    with live_server(settings_for(bundle=bundle, routes="diffusion=1")) as live, \
            live.client() as client:
        info = client.get("/v1/info").json()["served"]
        assert "diffusion" in info["paths"] and "ranked" not in info["paths"]
        answer = client.post("/v1/retrieve", json={"query": "tree", "route": "diffusion"})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["route"] == "diffusion" and not body["fallback"]["used"]
        assert len({item["id"] for item in body["items"]}) == 10
