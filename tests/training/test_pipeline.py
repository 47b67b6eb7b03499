"""`build_bundle`: one staleness rule for every stage, its plan, build.json, and the staging
helper. The whole tiny bundle (every stage's `tiny` preset) is built once per module."""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

from service.artifacts.bundle import (
    MANIFEST,
    new_manifest,
    read_manifest,
    stage,
    stage_hash,
    stage_status,
    verify_bundle,
    write_json_atomic,
    write_manifest,
)
from service.artifacts.progress import BUILD_STATUS, read_build_status
from service.artifacts.stages import PIPELINE, SHIPPED_STAGES
from service.errors import BundleError
from service.runtime.encoder import EncoderConfig
from tests.training.stage1_fanout.test_policy import make_tiny_bundle
from training.pipeline import CatalogConfig, build_bundle
from training.recipe import Recipe

MODEL_STAGES = ("folm-warmstart", "folm", "synthesis", "diffusion")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CatalogConfig, dict, float]:
    """A tiny bundle built by `build_bundle` from scratch: (bundle, its config, its manifest,
    the build's wall time)."""
    root = tmp_path_factory.mktemp("pipeline")
    make_tiny_bundle(root)  # writes the sources (and a catalog-only bundle we do not use)
    config = CatalogConfig(source=str(root / "catalog.jsonl"), benchmark=str(root / "bench.jsonl"))
    bundle = root / "full"
    started = time.perf_counter()
    manifest = build_bundle(bundle, config, presets="tiny")
    return bundle, config, copy.deepcopy(manifest), time.perf_counter() - started


def copy_of(bundle: Path, target: Path) -> Path:
    shutil.copytree(bundle, target)
    return target


def plan_of(bundle: Path) -> dict[str, str]:
    status = read_build_status(bundle)
    assert status is not None
    return {step["stage"]: f"{step['action']} ({step['reason']})" if step["reason"]
            else step["action"] for step in status["plan"]}


def test_a_built_bundle_is_current_and_rebuilds_nothing(built, capsys) -> None:
    bundle, config, first, wall = built
    print(f"tiny bundle built in {wall:.0f} s")
    assert set(PIPELINE) <= set(verify_bundle(bundle)["stages"])
    status = read_build_status(bundle)
    assert status["state"] == "done" and status["error"] is None
    assert status["finished"] == list(PIPELINE)
    assert plan_of(bundle) == dict.fromkeys(PIPELINE, "build (absent)")
    stages = first["stages"]
    assert stages["benchmark"]["inputs"] == {"catalog": stage_hash(first, "catalog")}
    assert stages["diffusion"]["inputs"] == {"catalog": stage_hash(first, "catalog"),
                                             "lexical": stage_hash(first, "lexical"),
                                             "synthesis": stage_hash(first, "synthesis")}
    assert stages["folm"]["inputs"]["folm-warmstart"] == stage_hash(first, "folm-warmstart")
    capsys.readouterr()

    from service.command import main

    assert main(["--bundle", str(bundle), "bundle", "--source", config.source, "--benchmark",
                 str(config.benchmark), "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n  {name}: current" in out for name in PIPELINE) and "up to date" in out
    assert read_manifest(bundle)["stages"] == stages
    assert plan_of(bundle) == dict.fromkeys(PIPELINE, "current")
    assert read_build_status(bundle)["finished"] == []


def test_a_stage_config_change_rebuilds_it_and_its_downstream_only(built, tmp_path) -> None:
    bundle, config, first, _ = built
    bundle = copy_of(bundle, tmp_path / "copy")
    tiny = Recipe.for_preset("tiny")
    configs = replace(tiny, synthesis=replace(tiny.synthesis, samples_per_query=4))
    manifest = build_bundle(bundle, config, presets=configs)
    assert plan_of(bundle) == {
        "catalog": "current", "lexical": "current", "benchmark": "current", "ranker": "current",
        "folm-warmstart": "current", "folm": "current", "synthesis": "rebuild (config changed)",
        "diffusion": "rebuild (synthesis changed)", "routes": "rebuild (diffusion changed)",
    }
    old, new = first["stages"], manifest["stages"]
    for name in ("catalog", "lexical", "benchmark", "folm-warmstart", "folm"):
        assert new[name] == old[name]
    assert new["synthesis"]["config"]["synthesis"]["samples_per_query"] == 4
    assert new["diffusion"]["inputs"]["synthesis"] == stage_hash(manifest, "synthesis")
    assert new["diffusion"]["inputs"]["synthesis"] != old["diffusion"]["inputs"]["synthesis"]
    assert new["diffusion"]["finished"] >= old["diffusion"]["finished"]
    build_bundle(bundle, config, presets=configs)
    assert set(plan_of(bundle).values()) == {"current"}
    build_bundle(bundle, config, presets=tiny)  # back to the preset: those two, then routes
    assert [s for s, a in plan_of(bundle).items() if a != "current"] == ["synthesis", "diffusion",
                                                                         "routes"]


def test_a_catalog_change_rebuilds_every_stage_downstream(built, tmp_path, capsys) -> None:
    bundle, config, first, _ = built
    bundle = copy_of(bundle, tmp_path / "copy")
    source = tmp_path / "more.jsonl"
    extra = {"id": "camping-whistle", "text": "whistle, camping whistle: gear used when "
             "camping outdoors, the whistle"}
    source.write_text(Path(config.source).read_text() + json.dumps(extra) + "\n")
    changed = replace(config, source=str(source))
    capsys.readouterr()
    manifest = build_bundle(bundle, changed, presets="tiny")
    out = capsys.readouterr().out
    assert "catalog: rebuild (config changed)" in out
    assert "folm-warmstart: rebuild (catalog, lexical, benchmark changed)" in out
    assert "diffusion: rebuild (catalog, lexical, synthesis changed)" in out
    assert "lexical: rebuild (catalog changed)" in out
    plan = plan_of(bundle)
    assert all(plan[name].startswith("rebuild") for name in PIPELINE)
    assert manifest["n_items"] == first["n_items"] + 1
    old, new = first["stages"], manifest["stages"]
    for name in MODEL_STAGES:
        assert new[name]["inputs"] != old[name]["inputs"], name
        assert new[name]["inputs"]["catalog"] == stage_hash(manifest, "catalog")
    assert verify_bundle(bundle)["stages"] == new


def test_staging_leaves_the_bundle_unchanged_when_the_body_raises(tmp_path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    write_manifest(bundle, new_manifest("t", EncoderConfig(), seed=0))
    manifest = read_manifest(bundle)
    with stage(bundle, manifest, "catalog", {"config_hash": "c1"}) as staged:
        (staged / "a.txt").write_text("a")
        (staged / "sub").mkdir()
        (staged / "sub" / "b.txt").write_text("b")
    committed = read_manifest(bundle)
    assert committed["stages"]["catalog"]["files"] == ["a.txt", "sub/b.txt"]  # all written
    assert committed["stages"]["catalog"]["inputs"] == {}
    before = sorted(p.relative_to(bundle) for p in bundle.rglob("*"))
    text = (bundle / MANIFEST).read_text()

    with (pytest.raises(RuntimeError, match="half way"),
          stage(bundle, committed, "catalog", {"config_hash": "c2"}) as staged):
        (staged / "a.txt").write_text("changed")
        raise RuntimeError("half way")
    assert (bundle / MANIFEST).read_text() == text
    assert sorted(p.relative_to(bundle) for p in bundle.rglob("*")) == before
    assert (bundle / "a.txt").read_text() == "a"

    record = {"config_hash": "b1"}
    with stage(bundle, committed, "benchmark", record) as staged:
        (staged / "only.txt").write_text("x")
        (staged / "scratch.tmp").write_text("not committed")
        record["files"] = ["only.txt"]
    manifest = verify_bundle(bundle)
    assert manifest["stages"]["benchmark"]["inputs"] == {"catalog": stage_hash(manifest,
                                                                              "catalog")}
    assert not (bundle / "scratch.tmp").exists()
    assert not [p for p in bundle.iterdir() if p.name.startswith(".staging")]
    with stage(bundle, manifest, "catalog", {"config_hash": "c3"}) as staged:  # a.txt only
        (staged / "a.txt").write_text("a2")
    manifest = verify_bundle(bundle)
    assert "sub/b.txt" not in manifest["files"] and not (bundle / "sub" / "b.txt").exists()


def test_stage_status_follows_config_and_inputs() -> None:
    manifest = {"stages": {}, "files": {"x": {"sha256": "1"}}}
    assert stage_status(manifest, "catalog", {"a": 1}) == ("build", "absent")
    from service.artifacts.bundle import config_hash

    manifest["stages"]["catalog"] = {"config_hash": config_hash({"a": 1}), "inputs": {},
                                     "files": ["x"]}
    assert stage_status(manifest, "catalog", {"a": 1}) == ("current", "")
    assert stage_status(manifest, "catalog", {"a": 2}) == ("rebuild", "config changed")
    manifest["stages"]["benchmark"] = {"config_hash": config_hash({}), "files": [],
                                       "inputs": {"catalog": stage_hash(manifest, "catalog")}}
    assert stage_status(manifest, "benchmark", {}) == ("current", "")
    assert stage_status(manifest, "benchmark", {}, ["catalog"]) == ("rebuild", "catalog changed")
    manifest["files"]["x"]["sha256"] = "2"  # the catalog was rebuilt with other contents
    assert stage_status(manifest, "benchmark", {}) == ("rebuild", "catalog changed")
    del manifest["stages"]["benchmark"]["inputs"]  # a record from before inputs were kept
    assert stage_status(manifest, "benchmark", {})[0] == "rebuild"


def test_the_warm_starts_key_holds_the_policy_it_builds(monkeypatch) -> None:
    """A prompt (or architecture) change of the policy preset alone rebuilds stage 1."""
    from training.pipeline import stage_keys
    from training.stage1_fanout import policy

    catalog = CatalogConfig(source="wordnet")
    before = stage_keys(catalog, Recipe.for_preset("tiny"))
    wider = replace(policy.POLICY_PRESETS["tiny"], context=6, candidates="dense")
    monkeypatch.setitem(policy.POLICY_PRESETS, "tiny", wider)
    after = stage_keys(catalog, Recipe.for_preset("tiny"))
    assert after["folm-warmstart"]["policy"]["candidates"] == "dense"
    assert after["folm-warmstart"] != before["folm-warmstart"]
    assert after["folm"] == before["folm"]  # GRPO's own config is unchanged; its input is not


def test_a_picking_teachers_blocks_are_keyed_by_the_students_context() -> None:
    """The ranker picks among the student's context: a new context size rebuilds stage 2, and
    a policy teacher (which writes sub-queries) has no context in its key."""
    from training.pipeline import stage_keys

    catalog = CatalogConfig(source="wordnet")
    recipe = Recipe.for_preset("cpu")
    context = recipe.diffusion.model.context
    picker = recipe.synthesis.teacher != "folm"
    assert picker and stage_keys(catalog, recipe)["synthesis"]["context"] == context
    wider = replace(recipe, diffusion=replace(recipe.diffusion, model=replace(
        recipe.diffusion.model, context=2 * context)))
    assert stage_keys(catalog, wider)["synthesis"] != stage_keys(catalog, recipe)["synthesis"]
    policy = replace(recipe, synthesis=replace(recipe.synthesis, teacher="folm"))
    assert "context" not in stage_keys(catalog, policy)["synthesis"]


def test_build_status_of_a_dead_build_reads_failed_and_a_live_one_blocks(tmp_path) -> None:
    assert read_build_status(tmp_path) is None
    status = {"state": "running", "pid": 2**22 + 12345, "plan": [], "finished": [],
              "current": "folm", "error": None}
    write_json_atomic(tmp_path / BUILD_STATUS, status)
    dead = read_build_status(tmp_path)
    assert dead["state"] == "failed" and "stopped" in dead["error"]
    write_json_atomic(tmp_path / BUILD_STATUS, {**status, "pid": os.getppid()})
    with pytest.raises(BundleError, match="being built"):
        build_bundle(tmp_path, CatalogConfig(), presets="tiny")


def test_a_jsonl_catalog_without_benchmark_fails_before_building(tmp_path) -> None:
    source = tmp_path / "c.jsonl"
    source.write_text(json.dumps({"id": "a", "text": "a thing"}) + "\n")
    with pytest.raises(BundleError, match="--benchmark"):
        build_bundle(tmp_path / "b", CatalogConfig(source=str(source)), presets="tiny")
    status = read_build_status(tmp_path / "b")
    assert status["state"] == "failed" and "--benchmark" in status["error"]
    assert not (tmp_path / "b" / MANIFEST).exists()


def test_shipped_stages_are_adopted_on_matching_inputs_and_rebuilt_on_a_changed_text(
        built, tmp_path, capsys) -> None:
    """A copy of shipped stages 1-3 stands in for training in a bundle built from scratch
    with the same catalog and recipe; a changed item text makes them train, saying why."""
    from training.pipeline import stage_keys
    from training.shipped import ShippedStages, ship

    bundle, config, first, _ = built
    tiny = Recipe.for_preset("tiny")
    out = ship(bundle, stage_keys(config, tiny), {"note": "tiny"}, tmp_path / "shipped")
    shipped = ShippedStages.open(out)
    assert shipped is not None and not (out / "runs").exists()

    fresh = tmp_path / "fresh"
    capsys.readouterr()
    manifest = build_bundle(fresh, config, presets=tiny, shipped=shipped)
    printed = capsys.readouterr().out
    for name in SHIPPED_STAGES:
        assert f"== {name}: shipped (adopted from {out})" in printed
        adopted, built = manifest["stages"][name], first["stages"][name]
        assert adopted["config_hash"] == built["config_hash"]
        assert adopted["build_wall_s"] == built["build_wall_s"] and "adopted_wall_s" in adopted
    assert "warm start:" not in printed  # nothing trained
    verify_bundle(fresh)
    assert plan_of(fresh)["diffusion"] == f"shipped (adopted from {out})"
    build_bundle(fresh, config, presets=tiny, shipped=shipped)
    assert set(plan_of(fresh).values()) == {"current"}

    source = tmp_path / "changed.jsonl"
    lines = Path(config.source).read_text().splitlines()
    record = json.loads(lines[0])
    record["text"] += " (edited)"
    source.write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")
    capsys.readouterr()
    build_bundle(fresh, replace(config, source=str(source)), presets=tiny, shipped=shipped)
    printed = capsys.readouterr().out
    assert "== folm-warmstart: rebuild (catalog, lexical, benchmark changed); not the shipped " \
           "copy: the shipped copy was built on another catalog, lexical, benchmark" in printed
    assert "shipped (adopted" not in printed


def test_the_catalog_stage_is_keyed_on_its_texts_not_its_float_bytes(built) -> None:
    """Embeddings that differ in their last bits (another CPU) keep the stages after the
    catalog current; a changed item text does not."""
    manifest = copy.deepcopy(built[2])
    before = stage_hash(manifest, "catalog")
    manifest["files"]["embeddings.npy"]["sha256"] = "0" * 64  # as another CPU would write it
    manifest["files"]["index.faiss"]["sha256"] = "1" * 64
    assert stage_hash(manifest, "catalog") == before
    manifest["stages"]["catalog"]["content"]["items.jsonl"] = "2" * 64
    assert stage_hash(manifest, "catalog") != before


def test_without_torch_a_build_adopts_shipped_stages_by_their_recorded_recipe(
        built, tmp_path, monkeypatch, capsys) -> None:
    """`make serve`'s install has no torch: the catalog stages build, stages 1-3 come from the
    shipped folder by the keys recorded there, and with no shipped folder the build stops after
    the catalog stages, naming what installs torch."""
    from training.pipeline import stage_keys
    from training.shipped import ShippedStages, ship

    bundle, config, _, _ = built
    out = ship(bundle, stage_keys(config, Recipe.for_preset("tiny")), {}, tmp_path / "shipped")

    def no_torch(preset: str, init: object = None) -> None:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(Recipe, "for_preset", staticmethod(no_torch))
    monkeypatch.setattr(ShippedStages, "for_preset", classmethod(lambda cls, p: cls.open(out)))
    manifest = build_bundle(tmp_path / "lean", config, presets="tiny")
    assert all(manifest["stages"][name]["shipped_from"] == str(out) for name in SHIPPED_STAGES)

    monkeypatch.setattr(ShippedStages, "for_preset", classmethod(lambda cls, p: None))
    with pytest.raises(BundleError, match="make bundle"):
        build_bundle(tmp_path / "bare", config, presets="tiny")
    assert set(read_manifest(tmp_path / "bare")["stages"]) == {"catalog", "lexical", "benchmark",
                                                                "ranker"}


def test_ship_refuses_an_out_folder_that_holds_something_else(built, tmp_path) -> None:
    from training.pipeline import stage_keys
    from training.shipped import ship

    bundle, config, _, _ = built
    other = tmp_path / "a-bundle"
    other.mkdir()
    (other / "manifest.json").write_text("{}")
    with pytest.raises(BundleError, match=r"holds no shipped\.json"):
        ship(bundle, stage_keys(config, Recipe.for_preset("tiny")), {}, other)
    assert (other / "manifest.json").read_text() == "{}"


def test_the_estimate_sums_the_reference_s_build_times_of_the_stages_it_will_train(
        tmp_path, capsys) -> None:
    from training.pipeline import print_estimate
    from training.shipped import ShippedStages

    record = {"build_wall_s": {"catalog": 30.0, "synthesis": 60.0, "diffusion": 600.0},
              "keys": {"synthesis": {"a": 1}, "diffusion": {"b": 2}}}
    reference = ShippedStages(tmp_path, record)
    keys = {"catalog": {}, "synthesis": {"a": 1}, "diffusion": {"b": 2}}
    print_estimate(tmp_path, list(keys), keys, reference, None)  # a user's catalog: all train
    assert "3 stages to build, about 12 min" in capsys.readouterr().out
    print_estimate(tmp_path, list(keys), keys, reference, reference)  # stages 2-3 adopted
    assert "3 stages to build, about 1 min" in capsys.readouterr().out
    other = {**keys, "diffusion": {"b": 3}}  # another recipe: its time is unknown
    print_estimate(tmp_path, list(other), other, reference, None)
    assert capsys.readouterr().out == ""
