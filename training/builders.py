"""The stage builders: one function per bundle stage that trains or commits it, called by the
planner (`training.pipeline`) for each stage its plan builds. Stages 1-3 import torch here,
only when they are built; each resumes its run folder only when it was started for the same
config and inputs (its build-key.json), else empties it first."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.artifacts.bundle import config_hash, read_manifest, stage_inputs, write_json_atomic
from service.artifacts.items import ItemStore
from service.artifacts.stages import AR_STAGE, AR_WARMSTART
from service.errors import BundleError
from training.data.bundle_stages import CatalogConfig, benchmark_stage, catalog_stage, lexical_stage
from training.data.catalog import Catalog, load_catalog
from training.device import device_of, distributed
from training.evaluation.routes import select_routes
from training.launcher import launch_grpo
from training.ranker.lambdarank import train_ranker
from training.recipe import NEEDS_TORCH, Recipe
from training.shipped import ShippedStages

RUN_KEY = "build-key.json"  # in a stage's run folder: the config and inputs it was started for


@dataclass
class StageBuild:
    """One build's inputs to every builder: the bundle, its catalog, recipe and stage keys."""

    bundle_dir: Path
    catalog_config: CatalogConfig
    configs: Recipe | None
    keys: dict[str, dict]
    force: bool
    shipped: ShippedStages | None = None
    _catalog: Catalog | None = field(default=None, repr=False)

    @property
    def catalog(self) -> Catalog:
        """The parsed catalog, loaded once and only by a build that needs it."""
        if self._catalog is None:
            self._catalog = load_catalog(self.catalog_config.source,
                                         self.catalog_config.index_factory)
        return self._catalog


def _build_catalog(build: StageBuild, manifest: dict[str, Any]) -> dict[str, Any]:
    catalog_stage(build.bundle_dir, manifest, build.catalog_config, build.catalog,
                  build.keys["catalog"])
    return manifest


def _build_lexical(build: StageBuild, manifest: dict[str, Any]) -> dict[str, Any]:
    lexical_stage(build.bundle_dir, manifest, ItemStore.load(build.bundle_dir).texts)
    return manifest


def _build_benchmark(build: StageBuild, manifest: dict[str, Any]) -> dict[str, Any]:
    benchmark_stage(build.bundle_dir, manifest, build.catalog_config, build.catalog)
    return manifest


def _build_ranker(build: StageBuild, manifest: dict[str, Any]) -> dict[str, Any]:
    return train_ranker(build.bundle_dir)


def _build_routes(build: StageBuild, manifest: dict[str, Any]) -> dict[str, Any]:
    return select_routes(build.bundle_dir)


def _build_warmstart(build: StageBuild, manifest: dict[str, Any]) -> dict[str, Any]:
    """Stage 1a: the warm start (`r4t train folm --warmstart-only`), exported to ONNX; with
    an init, that checkpoint as it is (the reference GRPO's KL holds the policy to)."""
    from training.stage1_fanout.warmstart import WARMSTART_RUN, warm_start

    configs = _configs(build)
    if configs.init:
        return _export_policy(build, Path(configs.init), AR_WARMSTART,
                              build.keys[AR_WARMSTART])
    run_dir = _run_dir(build, manifest, AR_WARMSTART, build.bundle_dir / "runs" / WARMSTART_RUN)
    final = warm_start(build.bundle_dir, configs.warmstart, run_dir)
    return _export_policy(build, final, AR_WARMSTART)


def _build_folm(build: StageBuild, manifest: dict[str, Any]) -> dict[str, Any]:
    """Stage 1b: GRPO from the warm start (`r4t train folm`), exported to ONNX."""
    from training.stage1_fanout.grpo import run_dir_for
    from training.stage1_fanout.grpo_run import train_grpo
    from training.stage1_fanout.warmstart import FINAL, WARMSTART_RUN

    configs = _configs(build)
    init = Path(configs.init) if configs.init else \
        _checkpoint(build.bundle_dir / "runs" / WARMSTART_RUN / FINAL, AR_WARMSTART)
    run_dir = _run_dir(build, manifest, AR_STAGE,
                       run_dir_for(build.bundle_dir, configs.grpo.reward))
    device = device_of()
    if device.kind == "cuda" and not distributed():
        launch_grpo(build.bundle_dir, configs.grpo, init, device.count)
        final = _checkpoint(run_dir / FINAL, AR_STAGE)
    else:
        final = train_grpo(build.bundle_dir, configs.grpo, init, run_dir, device=device.kind)
    return _export_policy(build, final, AR_STAGE)


def _build_synthesis(build: StageBuild, manifest: dict[str, Any]) -> dict[str, Any]:
    """Stage 2 (`r4t synthesize`): sample the recipe's teacher (the ranker, or the GRPO
    policy) into runs/synthesis."""
    from training.stage1_fanout.grpo import run_dir_for
    from training.stage1_fanout.warmstart import FINAL
    from training.stage2_synthesis.backends import chosen_backend
    from training.stage2_synthesis.synthesis import (
        POLICY_ONNX,
        SYNTHESIS_RUN,
        block_context,
        commit_synthesis,
        synthesize,
    )

    configs = _configs(build)
    run_dir = _run_dir(build, manifest, "synthesis", build.bundle_dir / "runs" / SYNTHESIS_RUN)
    context = block_context(configs.synthesis, configs.diffusion.model.context)
    if context is not None:  # the ranker: blocks among the student's context
        from training.stage2_synthesis.teachers import synthesize_blocks

        among = configs.diffusion.model.among
        synthesize_blocks(build.bundle_dir, configs.synthesis.teacher, configs.synthesis,
                          context, run_dir, among)
        return commit_synthesis(build.bundle_dir, configs.synthesis, run_dir, context, among)
    policy = _checkpoint(run_dir_for(build.bundle_dir, configs.grpo.reward) / FINAL, AR_STAGE)
    local = chosen_backend(configs.synthesis.backend, configs.synthesis.decoding) == "local"
    if local and not (run_dir / POLICY_ONNX).exists():  # it samples the bundle's export
        shutil.copytree(build.bundle_dir / AR_STAGE, run_dir / POLICY_ONNX)
    synthesize(build.bundle_dir, configs.synthesis, policy, run_dir)
    return commit_synthesis(build.bundle_dir, configs.synthesis, run_dir)


def _build_diffusion(build: StageBuild, manifest: dict[str, Any]) -> dict[str, Any]:
    """Stage 3 (`r4t train diffusion --threads 1`, `r4t export diffusion`). An export-only
    change resumes the finished training run: only the export is redone."""
    import torch

    from training.stage3_diffusion.export import export_diffusion
    from training.stage3_diffusion.trainer import CHECKPOINT, RUN_NAME, train_on_bundle

    configs = _configs(build)
    torch.set_num_threads(configs.threads)
    device = device_of().torch  # a checkpoint resumes on its own device kind only
    key = configs.diffusion.to_dict() | ({"device": device} if device != "cpu" else {})
    run_dir = _run_dir(build, manifest, "diffusion", build.bundle_dir / "runs" / RUN_NAME, key)
    train_on_bundle(build.bundle_dir, configs.diffusion, run_dir=run_dir, device=device)
    export_diffusion(build.bundle_dir, run_dir / CHECKPOINT, configs.export)
    return read_manifest(build.bundle_dir)


BUILDERS: dict[str, Callable[[StageBuild, dict[str, Any]], dict[str, Any]]] = {
    "catalog": _build_catalog, "lexical": _build_lexical, "benchmark": _build_benchmark,
    "ranker": _build_ranker, "routes": _build_routes,
    AR_WARMSTART: _build_warmstart, AR_STAGE: _build_folm,
    "synthesis": _build_synthesis, "diffusion": _build_diffusion,
}


def _configs(build: StageBuild) -> Recipe:
    if build.configs is None:
        raise BundleError(f"{build.bundle_dir}: stages 1-3 must be trained, and {NEEDS_TORCH}")
    return build.configs


def _export_policy(build: StageBuild, checkpoint: Path, name: str,
                   key: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch

    from training.stage1_fanout.export import commit_policy

    torch.set_num_threads(_configs(build).threads)
    commit_policy(build.bundle_dir, checkpoint, name, key)
    return read_manifest(build.bundle_dir)


def _checkpoint(path: Path, stage_name: str) -> Path:
    if not (path / "policy.json").is_file():
        raise BundleError(f"no checkpoint at {path}, which the `{stage_name}` stage trained: "
                          "rebuild with --force")
    return path


def _run_dir(build: StageBuild, manifest: dict[str, Any], name: str, run_dir: Path,
             config: dict[str, Any] | None = None) -> Path:
    """A stage's run folder, resumed when it was started for this config (default: the
    stage's key) and these inputs, else (and always with --force) emptied first."""
    key = {"stage": name, "config_hash": config_hash(build.keys[name] if config is None
                                                     else config),
           "inputs": stage_inputs(manifest, name)}
    if run_dir.exists() and (build.force or _read_json(run_dir / RUN_KEY) != key):
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / RUN_KEY, key)
    return run_dir


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


