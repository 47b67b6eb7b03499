"""The shipped default stages (models/shipped/default): the recipe the code builds now, small,
intact, adopted by a default bundle built here from scratch without training anything, and
still reaching, served through the routes' own path objects, the val figures they were
shipped with (a change that silently degrades the shipped model fails here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.artifacts.bundle import config_hash, sha256_file, verify_bundle
from service.artifacts.stages import SHIPPED_STAGES
from training import builders
from training.evaluation.regression import CHECKED, MARGIN, METRICS, below_hybrid, regressions
from training.pipeline import CatalogConfig, build_bundle, stage_keys
from training.recipe import Recipe
from training.shipped import SHIPPED_PRESET, ShippedStages

SHIPPED = ShippedStages.for_preset(SHIPPED_PRESET)
MAX_BYTES = 25 * 2**20  # the repository cost the shipped stages may have
REGENERATE = "run `make ship` and commit models/shipped/default (README: shipped stages)"


def shipped() -> ShippedStages:
    assert SHIPPED is not None, f"no shipped stages: {REGENERATE}"
    return SHIPPED


def test_the_shipped_stages_are_the_recipe_the_code_builds_now() -> None:
    stages = shipped()
    keys = stage_keys(CatalogConfig(), Recipe.for_preset(SHIPPED_PRESET))
    stale = [name for name in SHIPPED_STAGES
             if stages.record["stages"][name]["config_hash"] != config_hash(keys[name])]
    assert not stale, f"{', '.join(stale)}: the recipe changed since they were shipped: " \
                      f"{REGENERATE}"


def test_the_shipped_files_are_intact_and_small() -> None:
    stages = shipped()
    files = stages.record["files"]
    assert {f for name in SHIPPED_STAGES for f in stages.record["stages"][name]["files"]} \
        == set(files)
    for name, record in files.items():
        assert sha256_file(stages.folder / name) == record["sha256"], name
    on_disk = sum(p.stat().st_size for p in stages.folder.rglob("*") if p.is_file())
    assert on_disk < MAX_BYTES


@pytest.fixture(scope="module")
def adopted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default bundle built from scratch here; stages 1-3 may only be adopted."""
    if not Path("/usr/share/wordnet/data.noun").is_file():
        pytest.fail("the default catalog needs Debian's wordnet-base (make install)")

    def train(build, manifest):  # reached only when a shipped stage does not match
        raise AssertionError("a shipped stage was not adopted: see the printed reason")

    def unmeasured(build, manifest):  # the routes stage: its own tests measure it
        return manifest

    bundle = tmp_path_factory.mktemp("shipped") / "default"
    saved = dict(builders.BUILDERS)
    builders.BUILDERS.update(dict.fromkeys(SHIPPED_STAGES, train), routes=unmeasured)
    try:
        build_bundle(bundle, CatalogConfig(), presets=SHIPPED_PRESET)
    finally:
        builders.BUILDERS.update(saved)
    return bundle


def test_a_default_bundle_built_here_adopts_every_shipped_stage(adopted) -> None:
    manifest = verify_bundle(adopted)
    for name in SHIPPED_STAGES:
        assert manifest["stages"][name]["shipped_from"] == str(shipped().folder)


def test_served_routes_still_reach_the_val_figures_they_were_shipped_with(adopted) -> None:
    figures = shipped().record["eval"]
    measured = regressions(adopted, figures)
    assert set(measured) == set(CHECKED)
    failed = {f"{method} {metric}": (round(r["now"], 4), round(r["shipped"], 4))
              for method, per in measured.items() for metric, r in per.items() if not r["ok"]}
    assert not failed, f"now vs shipped, tolerance {figures['tolerance']}: {failed}"
    assert all(set(per) == set(METRICS) for per in measured.values())
    assert not below_hybrid(measured), f"leads over hybrid below {MARGIN}"
