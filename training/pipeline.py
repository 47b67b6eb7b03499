"""Builds a bundle stage by stage, rebuilding only the stages that are not current.

Stages, in order (`service.artifacts.stages` says which stages each one reads):
`catalog`
(parse → embed → FAISS index), `benchmark` (broad queries and their splits), stage 1
`folm-warmstart` and `folm` (the fan-out LM's warm start and its GRPO policy, each exported to
ONNX), stage 2 `synthesis` (the denoiser's training set: a run folder, no bundle files) and
stage 3 `diffusion` (the denoiser, trained and exported with its sampler). A stage is current
when its record's config hash is that of the config it would be built with now and every input
is still the record it was built from (`service.artifacts.bundle.stage_status`): a catalog change
rebuilds everything downstream. Each stage commits through `service.artifacts.bundle.stage`, so a
failed
stage leaves the bundle as it was; a stage's run folder (`runs/...`) is resumed only when it
was started for the same config and inputs (its build-key.json), else emptied first.
`build_bundle` prints its plan first and keeps `<bundle>/build.json` up to date.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from service.artifacts.bundle import (
    config_hash,
    new_manifest,
    read_manifest,
    stage_status,
    write_manifest,
)
from service.artifacts.stages import (
    AR_STAGE,
    AR_WARMSTART,
    CATALOG_STAGES,
    LABELED_STAGES,
    SHIPPED_STAGES,
)
from service.errors import BundleError
from service.runtime.encoder import EncoderConfig
from training.builders import BUILDERS, StageBuild
from training.data.bundle_stages import (
    LEXICAL_KEY,
    CatalogConfig,
    benchmark_key,
    catalog_key,
    check_encoder_dim,
)
from training.data.catalog import WORDNET
from training.evaluation.routes import routes_stage_config
from training.progress import BuildProgress
from training.ranker.lambdarank import RankerTrainConfig, ranker_stage_config
from training.recipe import NEEDS_TORCH, Recipe, init_key, resolve_recipe
from training.shipped import SHIPPED_PRESET, ShippedStages


def stage_keys(catalog: CatalogConfig, configs: Recipe | None = None) -> dict[str, dict]:
    """{stage: the config its record's config_hash must be the hash of}, in build order;
    the catalog stages alone without `configs`."""
    keys: dict[str, dict] = {"catalog": catalog_key(catalog), "lexical": LEXICAL_KEY,
                             "benchmark": benchmark_key(catalog),
                             "ranker": ranker_stage_config(RankerTrainConfig())}
    if configs is not None:
        from training.stage1_fanout.export import policy_stage_config
        from training.stage1_fanout.policy import POLICY_PRESETS
        from training.stage2_synthesis.synthesis import block_context, synthesis_stage_config
        from training.stage3_diffusion.export import diffusion_stage_config

        if configs.ar:
            keys[AR_WARMSTART] = init_key(Path(configs.init)) if configs.init else \
                policy_stage_config(asdict(configs.warmstart),
                                    asdict(POLICY_PRESETS[configs.warmstart.preset]))
            keys[AR_STAGE] = policy_stage_config(asdict(configs.grpo))
        keys["synthesis"] = synthesis_stage_config(
            configs.synthesis, block_context(configs.synthesis, configs.diffusion.model.context),
            configs.diffusion.model.among)
        keys["diffusion"] = diffusion_stage_config(configs.export,
                                                   config_hash(configs.diffusion.to_dict()))
    return keys


def plan_stages(
    manifest: dict[str, Any], keys: dict[str, dict], force: bool = False,
    has_benchmark: bool = True,
) -> list[dict[str, str]]:
    """[{"stage", "action", "reason"}] in build order; action is current, build, rebuild or
    skip (a JSONL catalog without a benchmark). A stage whose input is (re)built is rebuilt."""
    plan: list[dict[str, str]] = []
    changing: list[str] = []
    for name in keys:
        if name in LABELED_STAGES and not has_benchmark:
            action, reason = "skip", "no benchmark for this catalog"
        elif force:
            present = name in manifest.get("stages", {})
            action, reason = ("rebuild" if present else "build"), "forced"
        else:
            action, reason = stage_status(manifest, name, keys[name], changing)
        if action in ("build", "rebuild"):
            changing.append(name)
        plan.append({"stage": name, "action": action, "reason": reason})
    return plan


def format_step(step: dict[str, str]) -> str:
    """`catalog: current`, `folm: rebuild (catalog changed)`, `diffusion: build (absent)`."""
    reason = f" ({step['reason']})" if step["reason"] else ""
    return f"{step['stage']}: {step['action']}{reason}"


def print_estimate(bundle_dir: Path, stages: list[str], keys: dict[str, dict],
                   reference: ShippedStages | None, shipped: ShippedStages | None) -> None:
    """One line before the work starts: about how long it takes, as the `reference` build (the
    shipped default) took on its machine (2 cores) for the same stages; a stage `shipped` (given
    for the default's catalog) has under the same key costs nothing. No line when a stage of
    stages 1-3 trains with a recipe the reference did not (its time is unknown)."""
    if reference is None:
        return
    recorded = reference.record.get("keys", {})
    trained = [name for name in stages
               if shipped is None or shipped.record.get("keys", {}).get(name) != keys[name]]
    if any(name in SHIPPED_STAGES and recorded.get(name) != keys[name] for name in trained):
        return
    seconds = reference.expected_seconds(trained)
    if seconds is not None:
        print(f"{bundle_dir}: {len(stages)} stages to build, about {max(1, round(seconds / 60))} "
              "min on 2 cores (as the shipped default's same stages took)", flush=True)


def build_catalog(bundle_dir: Path, config: CatalogConfig, force: bool = False) -> dict[str, Any]:
    """Run the catalog and benchmark stages that are not current; return the manifest."""
    manifest = _build(Path(bundle_dir), config, None, force)
    stages = manifest.get("stages", {})
    summary = {k: stages[k] for k in (*CATALOG_STAGES, "ranker") if k in stages}
    print(json.dumps(summary, indent=2))
    return manifest


def build_bundle(
    bundle_dir: Path, catalog_config: CatalogConfig, force: bool = False,
    presets: str | Recipe = "cpu", use_shipped: bool = True,
    shipped: ShippedStages | None = None,
) -> dict[str, Any]:
    """Build every stage that is not current (all with `force`), in order, after printing
    the plan; `<bundle>/build.json` follows the build. Stages 1-3 are adopted from `shipped`
    (default: the preset's in the repository, unless `use_shipped` is off) where they match.
    Returns the manifest."""
    bundle_dir = Path(bundle_dir)
    configs, repository = resolve_recipe(presets)  # a bad preset is refused before any write
    shipped = (shipped or repository) if use_shipped else None
    progress = BuildProgress(bundle_dir)
    try:
        if catalog_config.source != WORDNET and not catalog_config.benchmark:
            raise BundleError("stages 1-3 train on the benchmark's train split: a JSONL "
                              "catalog needs its --benchmark")
        manifest = _build(bundle_dir, catalog_config, configs, force, progress, shipped)
        if configs is None and shipped is None:  # the catalog stages only: no recipe here
            raise BundleError(f"stages 1-3 must be trained, and {NEEDS_TORCH}")
    except BaseException as exc:
        progress.update(state="failed", error=f"{type(exc).__name__}: {exc}")
        raise
    progress.update(state="done", current=None)
    return manifest


def _build(
    bundle_dir: Path, config: CatalogConfig, configs: Recipe | None, force: bool,
    progress: BuildProgress | None = None, shipped: ShippedStages | None = None,
) -> dict[str, Any]:
    manifest = _existing(bundle_dir)
    if manifest and manifest["encoder"]["dim"] != config.dim:
        raise BundleError(
            f"{bundle_dir} was built with dim {manifest['encoder']['dim']}, not {config.dim}; "
            "use another bundle name"
        )
    check_encoder_dim(config)
    keys = stage_keys(config, configs)
    if configs is None and shipped is not None:  # no torch: the recipe the stages shipped with
        keys |= shipped.keys
    if configs is not None or shipped is not None:  # a whole bundle: its routes, measured last
        keys["routes"] = routes_stage_config()
    plan = plan_stages(manifest, keys, force, config.source == WORDNET or bool(config.benchmark))
    print(f"{bundle_dir}:" + "".join(f"\n  {format_step(step)}" for step in plan), flush=True)
    if progress:
        progress.update(plan=plan)
    todo = [step for step in plan if step["action"] in ("build", "rebuild")]
    if not todo:
        print(f"{bundle_dir}: every stage is up to date")
        return manifest
    print_estimate(bundle_dir, [step["stage"] for step in todo], keys,
                   ShippedStages.for_preset(SHIPPED_PRESET),
                   shipped if config.source == WORDNET else None)
    build = StageBuild(bundle_dir, config, configs, keys, force, shipped)
    if any(step["stage"] in CATALOG_STAGES for step in todo):
        build.catalog  # noqa: B018 - validate the catalog before any write
    bundle_dir.mkdir(parents=True, exist_ok=True)
    manifest = manifest or new_manifest(bundle_dir.name, EncoderConfig(dim=config.dim),
                                        config.seed)
    for step in todo:
        name = step["stage"]
        if not force and step["action"] == "rebuild" and \
                stage_status(manifest, name, keys[name])[0] == "current":
            step.update(action="current", reason="its inputs were rebuilt unchanged")
            print(f"== {format_step(step)}", flush=True)
            if progress:
                progress.update(plan=plan)
            continue
        if progress:
            progress.update(current=name)
        began = time.perf_counter()
        manifest = _adopt_or_build(build, manifest, step)
        manifest = record_build_wall(bundle_dir, name, time.perf_counter() - began)
        if progress:
            progress.update(current=None, finished=[*progress.status["finished"], name])
    print(f"{bundle_dir}: done", flush=True)
    return manifest


def _adopt_or_build(build: StageBuild, manifest: dict[str, Any], step: dict[str, str]) -> dict:
    """Adopt the shipped stage when it matches this build's config and inputs, else build it,
    saying first why the shipped copy was not used."""
    name = step["stage"]
    why_not = None
    if build.shipped is not None and name in SHIPPED_STAGES and not build.force:
        why_not = build.shipped.mismatch(name, build.keys[name], manifest)
        if why_not is None:
            step.update(action="shipped", reason=f"adopted from {build.shipped.folder}")
            print(f"== {format_step(step)}", flush=True)
            return build.shipped.adopt(build.bundle_dir, manifest, name)
    note = f"; not the shipped copy: {why_not}" if why_not else ""
    print(f"== {format_step(step)}{note}", flush=True)
    return BUILDERS[name](build, manifest)


def record_build_wall(bundle_dir: Path, name: str, wall_s: float) -> dict[str, Any]:
    """Add the stage's whole wall time here (training, export and commit) to its record as
    `build_wall_s`: the figure the README's per-stage table quotes; an adopted stage keeps the
    one it was shipped with and gets `adopted_wall_s`. Returns the manifest."""
    manifest = read_manifest(bundle_dir)
    record = manifest.get("stages", {}).get(name)
    if record is not None:
        record["adopted_wall_s" if "shipped_from" in record else "build_wall_s"] = \
            round(wall_s, 1)
        write_manifest(bundle_dir, manifest)
    return manifest


def _existing(bundle_dir: Path) -> dict[str, Any]:
    try:
        return read_manifest(bundle_dir)
    except BundleError:
        return {}


def recorded_catalog(bundle_dir: Path) -> dict[str, Any]:
    """The catalog config an existing bundle was built with ({} for a new one)."""
    manifest = _existing(Path(bundle_dir))
    return dict(manifest.get("config", {})) if manifest else {}
