"""Route assembly loads the bundle's ranker once and hands it to every route that reads it."""

from __future__ import annotations

import shutil

import pytest

from service.artifacts.bundle import load_bundle
from service.ranker.ranker import Ranker
from service.runtime.encoder import Encoder
from service.scheduling.assembly import Loaders, load_routes
from service.settings import Settings


@pytest.fixture
def ranker_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every `Ranker.load` from now on, by folder."""
    loads: list[str] = []
    original = Ranker.load.__func__  # type: ignore[attr-defined]

    def counting(cls, directory, manifest=None):
        loads.append(str(directory))
        return original(cls, directory, manifest)

    monkeypatch.setattr(Ranker, "load", classmethod(counting))
    return loads


def _routes(directory):
    bundle = load_bundle(directory)
    paths, problems = load_routes(Settings(bundle=directory), bundle,
                                  Encoder(bundle.encoder_config), Loaders())
    return paths, problems


def test_a_ranker_s_student_and_the_ranked_route_share_one_ranker(small_bundle_dir, tmp_path,
                                                                   ranker_loads):
    import torch

    from tests.training.stage3_diffusion.proxy_dataset import tiny_checkpoint
    from training.stage3_diffusion.export import ExportConfig, export_diffusion

    torch.set_num_threads(1)
    directory = tmp_path / "b"
    shutil.copytree(small_bundle_dir, directory, ignore=shutil.ignore_patterns("runs"))
    export_diffusion(directory, tiny_checkpoint(tmp_path / "run", context=4, steps=2,
                                                context_source="ranked", layers=1),
                     ExportConfig())
    paths, problems = _routes(directory)
    assert {"diffusion", "ranked"} <= set(paths), problems
    assert len(ranker_loads) == 1
    assert paths["diffusion"].context.prompt.scored is paths["ranked"].scored


def test_a_standalone_student_reads_the_ranker_s_item_side(serving_bundle, ranker_loads):
    paths, problems = _routes(serving_bundle)
    assert {"diffusion", "ranked"} <= set(paths), problems
    assert len(ranker_loads) == 1
    mentions = paths["diffusion"].context.mentions.features
    assert mentions.item_words is paths["ranked"].scored.features.item_words
