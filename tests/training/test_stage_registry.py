"""The build follows the stage registry: one builder per stage `r4t bundle` builds, and the
plan's order is the registry's."""

from __future__ import annotations

from service.artifacts.stages import PIPELINE
from training.builders import BUILDERS
from training.pipeline import CatalogConfig, stage_keys
from training.recipe import Recipe


def test_every_built_stage_has_one_builder():
    assert set(BUILDERS) == set(PIPELINE)


def test_the_plan_builds_in_the_registry_s_order():
    keys = list(stage_keys(CatalogConfig(), Recipe.for_preset("tiny")))
    assert keys == [s for s in PIPELINE if s in keys] and len(keys) == len(PIPELINE) - 1
    assert PIPELINE[-1] == "routes"  # measured last, over every other stage's route
    catalog = list(stage_keys(CatalogConfig()))  # `r4t catalog`'s plan: a prefix
    assert catalog == keys[: len(catalog)]
