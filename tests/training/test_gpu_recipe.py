"""The accelerator recipe (docs/gpu.md) end to end on the CPU: a tiny randomly initialised HF
checkpoint shaped like a foreign LLM's (written here) → `r4t bundle --preset gpu-smoke --init`
→ the service answers both paths from the bundle it built."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from service.artifacts.bundle import read_manifest, verify_bundle
from service.artifacts.stages import PIPELINE
from service.command import main
from tests.service.live import live_server, make_settings
from tests.training.stage1_fanout.test_policy import write_tiny_sources
from training.pipeline import (
    CatalogConfig,
    build_bundle,
    plan_stages,
    stage_keys,
)
from training.recipe import Recipe
from training.stage1_fanout.policy import load_tokenizer
from training.stage1_fanout.random_init import write_random_checkpoint


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, CatalogConfig]:
    """(bundle, init checkpoint, catalog config) of the whole smoke recipe (the issue bounds
    it at 60 s in `make test`: see this fixture's setup time under --durations)."""
    root = tmp_path_factory.mktemp("gpu-recipe")
    catalog, bench = write_tiny_sources(root)
    config = CatalogConfig(source=str(catalog), benchmark=str(bench))
    texts = [json.loads(line)["text"] for line in catalog.read_text().splitlines()]
    init = write_random_checkpoint(root / "init", texts)
    bundle = root / "recipe"
    build_bundle(bundle, config, presets=Recipe.for_preset("gpu-smoke", init))
    return bundle, init, config


def test_the_checkpoint_is_foreign(recipe) -> None:
    """Not ours: no policy.json, no BOS, a vocabulary padded past the tokenizer's ids."""
    _, init, _ = recipe
    tokenizer = load_tokenizer(init)
    model_vocab = json.loads((init / "config.json").read_text())["vocab_size"]
    assert not (init / "policy.json").exists()
    assert tokenizer.bos_token_id is None
    assert model_vocab > len(tokenizer)


def test_the_recipe_builds_every_stage_from_the_checkpoint(recipe, capsys) -> None:
    bundle, init, config = recipe
    manifest = read_manifest(bundle)
    verify_bundle(bundle)
    assert set(PIPELINE) <= set(manifest["stages"])
    warm = manifest["stages"]["folm-warmstart"]
    assert warm["config"]["init"]["path"] == str(init.resolve())
    assert warm["checkpoint"] == str(init.resolve())
    run = json.loads((bundle / "runs" / "folm-about" / "config.json").read_text())
    assert run["init"] == str(init.resolve())
    assert run["config"]["preset"] == "gpu-smoke"
    assert run["device"]["kind"] == "cpu"
    exported = json.loads((bundle / "folm" / "folm.json").read_text())
    assert exported["bos_id"] is None and exported["preset"] == "foreign"
    assert exported["vocab_size"] > len(load_tokenizer(init))
    build_bundle(bundle, config, presets=Recipe.for_preset("gpu-smoke", init))
    assert "every stage is up to date" in capsys.readouterr().out


def test_a_checkpoint_changed_in_place_rebuilds_stage_1_and_after(recipe) -> None:
    """The same folder with rewritten weights (a newer mtime) is another teacher."""
    bundle, init, config = recipe
    weights = init / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        keys = stage_keys(config, Recipe.for_preset("gpu-smoke", init))
        plan = {step["stage"]: step["action"] for step in plan_stages(read_manifest(bundle), keys)}
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert {plan[s] for s in ("catalog", "lexical", "benchmark")} == {"current"}
    assert {plan[s] for s in ("folm-warmstart", "folm", "synthesis", "diffusion")} == {"rebuild"}


def test_the_service_answers_both_paths_from_the_recipes_bundle(recipe) -> None:
    bundle, _, _ = recipe
    settings = make_settings(bundle, None, routes="diffusion=1.0", index="bundle")
    with live_server(settings) as server, server.client() as client:
        for route in ("diffusion", "ar"):
            answer = client.post("/v1/retrieve", json={"query": "camping", "k": 5,
                                                       "route": route})
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["route"] == route
            assert len({item["id"] for item in body["items"]}) == 5


@pytest.mark.parametrize("argv", [["bundle", "--preset", "gpu"],
                                  ["bundle", "--preset", "gpu-smoke", "--init", "/nonexistent"]])
def test_the_recipe_refuses_a_missing_checkpoint(argv, tmp_path, capsys) -> None:
    assert main(["--bundle", str(tmp_path / "b"), *argv]) == 2
    error = capsys.readouterr().err
    assert "--init" in error and "Traceback" not in error
    assert not (tmp_path / "b").exists()
