"""The one stage registry: a stage reads only stages built before it, and every role's list is a
view of it."""

from __future__ import annotations

from service.artifacts.stages import (
    CATALOG_STAGES,
    PIPELINE,
    ROUTE_STAGES,
    STAGE,
    STAGES,
    inputs_of,
)
from service.routes import ROUTE_ORDER


def test_a_stage_reads_only_stages_before_it():
    seen: set[str] = set()
    for spec in STAGES:
        assert set(spec.inputs) <= seen, spec.name
        seen.add(spec.name)
    assert len(seen) == len(STAGES)  # each name once


def test_the_catalog_stages_come_first_and_r4t_catalog_builds_them():
    assert PIPELINE[: len(CATALOG_STAGES)] == CATALOG_STAGES
    assert all("catalog" in STAGE[name].command for name in CATALOG_STAGES)


def test_each_fan_out_route_names_a_stage_and_unknown_stages_read_nothing():
    assert set(ROUTE_STAGES) <= set(ROUTE_ORDER) and set(ROUTE_STAGES.values()) <= set(STAGE)
    assert inputs_of("no-such-stage") == ()
