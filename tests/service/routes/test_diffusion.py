"""The diffusion route stands alone: its context is the query's nearest items and their mention
features (service.ranker.mention_context), so it serves from a bundle without the ranker's
files."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from service.artifacts.bundle import read_manifest, write_manifest
from service.ranker.ranker import RANKER_DIR
from service.routes.diffusion import draw_rows
from service.runtime.sampler import Draw
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



class TwoDraws:
    """A sampler stand-in with a weights output, run with draws = 2: each row points at the
    item its noise-free weights name, so which rows survive is known."""

    pointed, items = True, None

    def __init__(self, pointing: list[list[int]], context: int) -> None:
        self.pointing, self.context = pointing, context  # per repeated query: each row's item
        self.providers, self.config = ["test"], {"draws": 2}

    def draw(self, query_emb, seed=None, noise=None, context=None, embeddings=None) -> Draw:
        weights = np.eye(self.context, dtype=np.float32)[np.array(self.pointing)]  # (B·D, L, C)
        return Draw(weights @ embeddings, weights)


def test_a_second_draw_replaces_a_repeated_row_with_its_weights():
    context = np.eye(4, dtype=np.float32)[None]  # (1, C, d): item c is axis c
    sampler = TwoDraws([[0, 0, 1], [2, 3, 1]], context=4)  # draw 1 repeats item 0
    drawn = draw_rows(None, sampler, np.zeros((1, 4), np.float32), 0, context)
    assert drawn.weights.argmax(axis=2).tolist() == [[0, 1, 2]]  # draw 2's first row fills in
    assert np.array_equal(drawn.rows, drawn.weights @ context)  # the rows kept are theirs


def test_a_projected_student_reads_its_item_table_and_the_compact_columns(serving_bundle):
    from service.artifacts.bundle import load_bundle
    from service.ranker.mention_context import COMPACT_WIDTH, one_hot
    from service.routes.diffusion import DiffusionContext
    from service.runtime.encoder import Encoder
    from service.runtime.sampler import DiffusionSampler

    bundle = load_bundle(serving_bundle)
    sampler = DiffusionSampler(serving_bundle / "diffusion", threads=1)
    assert sampler.items is not None and len(sampler.items) == len(bundle.items.ids)
    context = DiffusionContext(bundle, sampler.config, items=sampler.items)
    texts = ["tree", "dog", "zzqx"]
    queries = Encoder(bundle.encoder_config).encode(texts)
    rows = context.rows(texts, queries)
    embeddings = context.embeddings(rows)
    served = context.served(embeddings, rows, queries, texts)  # what the graph reads
    full = context.features(embeddings, rows, queries, texts)  # what the model trained on
    h = sampler.items.shape[1]
    assert served.shape == (*rows.shape, sampler.width) == (*rows.shape, h + COMPACT_WIDTH)
    np.testing.assert_array_equal(served[..., :h], sampler.items[rows])
    np.testing.assert_array_equal(full[..., : embeddings.shape[2]], embeddings)
    np.testing.assert_array_equal(one_hot(served[..., h:]), full[..., embeddings.shape[2]:])
