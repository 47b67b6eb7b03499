"""Builds a bundle stage by stage, rebuilding only the stages that are not current.

Stages, in order (`service.artifacts.bundle.STAGE_INPUTS` says which stages each one reads):
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

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from service.artifacts.bundle import (
    BUILD_STATUS,
    CONTENT_KEY,
    INDEX_FILE,
    config_hash,
    new_manifest,
    now_iso,
    read_build_status,
    read_manifest,
    sha256_file,
    stage,
    stage_inputs,
    stage_status,
    write_json_atomic,
    write_manifest,
)
from service.artifacts.items import ITEMS_FILE, ItemStore
from service.artifacts.lexical import LEXICAL_FILE, MAX_DF, TOKENIZER, build_lexical_index
from service.errors import BundleError
from service.runtime.encoder import ENCODER_FOLDER, MATRYOSHKA_DIMS, Encoder, EncoderConfig
from service.runtime.index import build_index, save_index
from training.data.catalog import WORDNET, Catalog, load_catalog
from training.data.encoder import encoder_source, export_encoder, source_key
from training.data.splits import read_benchmark_file, split_queries, wordnet_queries, write_splits
from training.device import device_of, distributed
from training.evaluation.routes import routes_stage_config, select_routes
from training.shipped import SHIPPED_STAGES, ShippedStages
from training.stage1_fanout.gguf import hf_checkpoint
from training.stage1_fanout.ranker import RankerTrainConfig, ranker_stage_config, train_ranker

if TYPE_CHECKING:  # stages 1-3 import torch: only when they are built
    from training.stage1_fanout.grpo import GrpoConfig
    from training.stage1_fanout.warmstart import WarmStartConfig
    from training.stage2_synthesis.synthesis import SynthesisConfig
    from training.stage3_diffusion.export import ExportConfig
    from training.stage3_diffusion.trainer import TrainConfig

EMBED_CHUNK = 4096
CATALOG_STAGES = ("catalog", "lexical", "benchmark")
LABELED_STAGES = ("benchmark", "ranker", "routes")  # skipped for a catalog without a benchmark
PIPELINE = (*CATALOG_STAGES, "ranker", "folm-warmstart", "folm", "synthesis", "diffusion",
            "routes")
BUNDLE_PRESETS = ("cpu", "tiny", "gpu", "gpu-smoke")
LLM_PRESETS = ("gpu", "gpu-smoke")  # the accelerator recipe (docs/gpu.md): they need an init
RUN_KEY = "build-key.json"  # in a stage's run folder: the config and inputs it was started for
GPU_DIFFUSION_STEPS = 200_000  # at the paper's batch: many passes over the synthesised blocks
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".json")  # weights, configs, tokenizer
TRAINING_PACKAGES = ("torch", "transformers", "trl", "onnx", "onnxscript")  # the train extra
NEEDS_TORCH = "torch is not installed here (make serve's install): `make bundle` installs it"


@dataclass(frozen=True)
class CatalogConfig:
    """What the catalog stage builds: source, encoder and its dimension, index type, split
    seed."""

    source: str = WORDNET  # "wordnet" or a path to a JSONL catalog
    benchmark: str | None = None  # JSONL benchmark for a user's catalog (WordNet derives its own)
    dim: int = 128
    encoder: str = "wordllama"  # or "minilm", or a local checkpoint (training.data.encoder)
    index_factory: str | None = None  # None = exact inner product ("Flat")
    seed: int = 0


LEXICAL_KEY: dict[str, Any] = {"engine": "sqlite-fts5", "tokenize": TOKENIZER, "max_df": MAX_DF}

CATALOG_PRESETS: dict[str, CatalogConfig] = {"default": CatalogConfig()}


@dataclass(frozen=True)
class StageConfigs:
    """What stages 1-3 are built with. `stage_configs("cpu")` is what `r4t train folm`,
    `r4t export folm`, `r4t synthesize`, `r4t train diffusion --threads 1` and
    `r4t export diffusion` build with their defaults."""

    warmstart: WarmStartConfig
    grpo: GrpoConfig
    synthesis: SynthesisConfig
    diffusion: TrainConfig
    export: ExportConfig
    threads: int = 1  # torch threads of the exports and the denoiser's training
    # a local HF causal-LM checkpoint stage 1 starts from instead of the warm start it trains
    init: str | None = None


def stage_configs(preset: str = "cpu", init: str | Path | None = None) -> StageConfigs:
    """Every stage's preset `preset` (cpu: the default bundle; tiny: tests, seconds; gpu:
    the accelerator recipe from the LLM `init`, gpu-smoke: the same in seconds)."""
    from training.stage1_fanout.grpo import GRPO_PRESETS
    from training.stage1_fanout.warmstart import WARMSTART_PRESETS
    from training.stage2_synthesis.synthesis import SYNTHESIS_PRESETS
    from training.stage3_diffusion.export import ExportConfig
    from training.stage3_diffusion.trainer import train_preset

    if preset not in BUNDLE_PRESETS:
        raise ValueError(f"unknown bundle preset {preset!r}; available: {BUNDLE_PRESETS}")
    if preset in LLM_PRESETS and init is None:
        raise BundleError(f"the {preset} preset trains a pretrained causal LM: name its local "
                          "checkpoint folder with --init (docs/gpu.md)")
    if init is not None:
        init = hf_checkpoint(init)
    if init is not None and not (Path(init) / "config.json").is_file():
        raise BundleError(f"--init {init}: no Hugging Face checkpoint there (config.json), "
                          "and no .gguf file or GGUF package")
    small = preset in ("tiny", "gpu-smoke")
    diffusion = train_preset("tiny" if small else "paper" if preset == "gpu" else "cpu")
    if preset == "gpu":  # the paper's denoiser, for a measured-length run (docs/gpu.md)
        diffusion = replace(diffusion, steps=GPU_DIFFUSION_STEPS)
    return StageConfigs(warmstart=WARMSTART_PRESETS["tiny" if small else "cpu"],
                        grpo=GRPO_PRESETS[preset], synthesis=SYNTHESIS_PRESETS[preset],
                        diffusion=diffusion, export=ExportConfig(),
                        threads=8 if preset == "gpu" else 1,
                        init=None if init is None else str(Path(init).resolve()))


def stage_keys(catalog: CatalogConfig, configs: StageConfigs | None = None) -> dict[str, dict]:
    """{stage: the config its record's config_hash must be the hash of}, in build order;
    the catalog stages alone without `configs`."""
    keys: dict[str, dict] = {"catalog": _catalog_key(catalog), "lexical": LEXICAL_KEY,
                             "benchmark": _benchmark_key(catalog),
                             "ranker": ranker_stage_config(RankerTrainConfig())}
    if configs is not None:
        from training.stage1_fanout.export import policy_stage_config
        from training.stage1_fanout.policy import POLICY_PRESETS
        from training.stage2_synthesis.synthesis import synthesis_stage_config
        from training.stage3_diffusion.export import diffusion_stage_config

        keys["folm-warmstart"] = init_key(Path(configs.init)) if configs.init else \
            policy_stage_config(asdict(configs.warmstart),
                                asdict(POLICY_PRESETS[configs.warmstart.preset]))
        keys["folm"] = policy_stage_config(asdict(configs.grpo))
        keys["synthesis"] = synthesis_stage_config(configs.synthesis)
        keys["diffusion"] = diffusion_stage_config(configs.export,
                                                   config_hash(configs.diffusion.to_dict()))
    return keys


def init_key(init: Path) -> dict[str, Any]:
    """What the `folm-warmstart` stage of a bundle trained from `init` is current by: the
    checkpoint's place, config and the size and time of each of its files (hashing a 4B
    model's weights at every plan would take a minute), and the prompt it is given."""
    from training.stage1_fanout.policy import foreign_policy

    files = sorted(path for path in init.iterdir() if path.suffix in CHECKPOINT_SUFFIXES)
    return {"init": {"path": str(init), "config_sha256": sha256_file(init / "config.json"),
                     "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]},
            "policy": foreign_policy()}


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


def build_catalog(bundle_dir: Path, config: CatalogConfig, force: bool = False) -> dict[str, Any]:
    """Run the catalog and benchmark stages that are not current; return the manifest."""
    manifest = _build(Path(bundle_dir), config, None, force)
    stages = manifest.get("stages", {})
    summary = {k: stages[k] for k in (*CATALOG_STAGES, "ranker") if k in stages}
    print(json.dumps(summary, indent=2))
    return manifest


def build_bundle(
    bundle_dir: Path, catalog_config: CatalogConfig, force: bool = False,
    presets: str | StageConfigs = "cpu", use_shipped: bool = True,
    shipped: ShippedStages | None = None,
) -> dict[str, Any]:
    """Build every stage that is not current (all with `force`), in order, after printing
    the plan; `<bundle>/build.json` follows the build. Stages 1-3 are adopted from `shipped`
    (default: the preset's in the repository, unless `use_shipped` is off) where they match.
    Returns the manifest."""
    bundle_dir = Path(bundle_dir)
    configs, repository = recipe(presets)  # a bad preset is refused before any write
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


def recipe(presets: str | StageConfigs) -> tuple[StageConfigs | None, ShippedStages | None]:
    """Stages 1-3's configs (None where torch is not installed: a serve-only install) and the
    preset's shipped stages, which a build adopts where they match."""
    if isinstance(presets, StageConfigs):
        return presets, None
    shipped = ShippedStages.for_preset(presets)
    try:
        return stage_configs(presets), shipped
    except ModuleNotFoundError as exc:
        if exc.name not in TRAINING_PACKAGES:
            raise
        return None, shipped


class BuildProgress:
    """`<bundle>/build.json`, rewritten atomically at every step of a build (see
    `service.artifacts.bundle.read_build_status`). Refuses a second live build of one bundle."""

    def __init__(self, bundle_dir: Path) -> None:
        running = read_build_status(bundle_dir)
        if running and running.get("state") == "running" and running.get("pid") != os.getpid():
            raise BundleError(f"{bundle_dir} is being built by process {running['pid']} "
                              f"({BUILD_STATUS})")
        self.path = bundle_dir / BUILD_STATUS
        self.status: dict[str, Any] = {
            "state": "running", "pid": os.getpid(), "started": now_iso(), "plan": [],
            "current": None, "finished": [], "error": None,
        }
        self.update()

    def update(self, **changes: Any) -> None:
        self.status.update(changes, updated=now_iso())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.status)


@dataclass
class _Build:
    bundle_dir: Path
    catalog_config: CatalogConfig
    configs: StageConfigs | None
    keys: dict[str, dict]
    force: bool
    shipped: ShippedStages | None = None
    _catalog: Catalog | None = field(default=None, repr=False)

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            self._catalog = load_catalog(self.catalog_config.source,
                                         self.catalog_config.index_factory)
        return self._catalog


def _build(
    bundle_dir: Path, config: CatalogConfig, configs: StageConfigs | None, force: bool,
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
    build = _Build(bundle_dir, config, configs, keys, force, shipped)
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


def _adopt_or_build(build: _Build, manifest: dict[str, Any], step: dict[str, str]) -> dict:
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


def embed_texts(encoder: Encoder, texts: list[str], desc: str = "embed") -> np.ndarray:
    """Encode in chunks with a progress bar: (N, dim) float32 unit rows."""
    out = np.empty((len(texts), encoder.dim), dtype=np.float32)
    with tqdm(total=len(texts), desc=desc, unit="item", unit_scale=True) as bar:
        for start in range(0, len(texts), EMBED_CHUNK):
            chunk = texts[start : start + EMBED_CHUNK]
            out[start : start + len(chunk)] = encoder.encode(chunk)
            bar.update(len(chunk))
    return out


def catalog_stage(
    bundle_dir: Path, manifest: dict, config: CatalogConfig, catalog: Catalog,
    key: dict[str, Any],
) -> None:
    """Embed the catalog, build the index, commit items + embeddings + index."""
    started = time.perf_counter()
    record: dict[str, Any] = {}
    with stage(bundle_dir, manifest, "catalog", record) as staged:
        encoder = catalog_encoder(config, staged)
        embeddings = embed_texts(Encoder(encoder), catalog.texts)
        with tqdm(total=1, desc=f"index ({config.index_factory or 'Flat'})") as bar:
            index = build_index(embeddings, config.index_factory)
            save_index(index, staged / INDEX_FILE)
            bar.update(1)
        store = ItemStore(catalog.ids, catalog.texts, embeddings, catalog.metadata)
        exported = sorted(p.relative_to(staged).as_posix()
                          for p in (staged / ENCODER_FOLDER).glob("*"))  # none for WordLlama
        files = [*store.save(staged), INDEX_FILE, *exported]
        record.update(_stage_record(key, started, n_items=len(catalog)),  # the plan's key
                      files=files)
        record[CONTENT_KEY] = {ITEMS_FILE: sha256_file(staged / ITEMS_FILE),
                               "encoder": encoder_content(encoder)}
        manifest["n_items"] = len(catalog)
        manifest["config"] = asdict(config)
        manifest["encoder"] = {"name": encoder.name, "dim": encoder.dim}
        if encoder.folder is not None:
            manifest["encoder"]["folder"] = ENCODER_FOLDER


def benchmark_stage(
    bundle_dir: Path, manifest: dict, config: CatalogConfig, catalog: Catalog
) -> None:
    """Derive (WordNet) or read (user file) the benchmark, split it, commit the splits."""
    started = time.perf_counter()
    if config.source == WORDNET:
        queries = wordnet_queries()
    elif config.benchmark:
        queries = read_benchmark_file(Path(config.benchmark), set(catalog.ids))
    else:
        return
    record: dict[str, Any] = {}
    with stage(bundle_dir, manifest, "benchmark", record) as staged:
        splits = split_queries(queries, config.seed)
        files = write_splits(splits, staged)
        counts = {name: len(qs) for name, qs in splits.items()}
        record.update(_stage_record(_benchmark_key(config), started, n_queries=counts),
                      files=files)


def _build_catalog(build: _Build, manifest: dict[str, Any]) -> dict[str, Any]:
    catalog_stage(build.bundle_dir, manifest, build.catalog_config, build.catalog,
                  build.keys["catalog"])
    return manifest


def lexical_stage(bundle_dir: Path, manifest: dict, texts: list[str]) -> None:
    """Index the item texts for BM25 search (service.artifacts.lexical)."""
    started = time.perf_counter()
    record: dict[str, Any] = {}
    with stage(bundle_dir, manifest, "lexical", record) as staged, \
            tqdm(total=1, desc="lexical index (FTS5)") as bar:
        build_lexical_index(staged / LEXICAL_FILE, texts)
        bar.update(1)
        record.update(_stage_record(LEXICAL_KEY, started, n_items=len(texts)),
                      files=[LEXICAL_FILE])
        record[CONTENT_KEY] = {}  # a function of its config and the catalog's texts


def _build_lexical(build: _Build, manifest: dict[str, Any]) -> dict[str, Any]:
    lexical_stage(build.bundle_dir, manifest, ItemStore.load(build.bundle_dir).texts)
    return manifest


def _build_benchmark(build: _Build, manifest: dict[str, Any]) -> dict[str, Any]:
    benchmark_stage(build.bundle_dir, manifest, build.catalog_config, build.catalog)
    return manifest


def _build_ranker(build: _Build, manifest: dict[str, Any]) -> dict[str, Any]:
    return train_ranker(build.bundle_dir)


def _build_routes(build: _Build, manifest: dict[str, Any]) -> dict[str, Any]:
    return select_routes(build.bundle_dir)


def _build_warmstart(build: _Build, manifest: dict[str, Any]) -> dict[str, Any]:
    """Stage 1a: the warm start (`r4t train folm --warmstart-only`), exported to ONNX; with
    an init, that checkpoint as it is (the reference GRPO's KL holds the policy to)."""
    from training.stage1_fanout.warmstart import WARMSTART_RUN, warm_start

    configs = _configs(build)
    if configs.init:
        return _export_policy(build, Path(configs.init), "folm-warmstart",
                              build.keys["folm-warmstart"])
    run_dir = _run_dir(build, manifest, "folm-warmstart", build.bundle_dir / "runs" / WARMSTART_RUN)
    final = warm_start(build.bundle_dir, configs.warmstart, run_dir)
    return _export_policy(build, final, "folm-warmstart")


def _build_folm(build: _Build, manifest: dict[str, Any]) -> dict[str, Any]:
    """Stage 1b: GRPO from the warm start (`r4t train folm`), exported to ONNX."""
    from training.stage1_fanout.grpo import run_dir_for, train_grpo
    from training.stage1_fanout.warmstart import FINAL, WARMSTART_RUN

    configs = _configs(build)
    init = Path(configs.init) if configs.init else \
        _checkpoint(build.bundle_dir / "runs" / WARMSTART_RUN / FINAL, "folm-warmstart")
    run_dir = _run_dir(build, manifest, "folm", run_dir_for(build.bundle_dir, configs.grpo.reward))
    device = device_of()
    if device.kind == "cuda" and not distributed():
        _launch_grpo(build, configs.grpo, init, device.count)
        final = _checkpoint(run_dir / FINAL, "folm")
    else:
        final = train_grpo(build.bundle_dir, configs.grpo, init, run_dir, device=device.kind)
    return _export_policy(build, final, "folm")


def _launch_grpo(build: _Build, config: GrpoConfig, init: Path, gpus: int) -> None:
    """GRPO on the GPUs: `r4t train folm` under `accelerate launch`, data-parallel over as
    many GPUs as split a step's prompts evenly, into the run folder this build prepared (the
    preset's). In its own processes even on one GPU: their exit frees the GPU memory (TRL's
    vLLM engine's too) for stage 2."""
    processes = max(n for n in range(1, gpus + 1) if config.queries_per_step % n == 0)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes",
               str(processes), "-m", "training.cli", "--bundle", str(build.bundle_dir), "train",
               "folm", "--preset", config.preset, "--init", str(init)]
    print("== " + " ".join(command), flush=True)
    subprocess.run(command, check=True)


def _build_synthesis(build: _Build, manifest: dict[str, Any]) -> dict[str, Any]:
    """Stage 2 (`r4t synthesize`): sample the recipe's teacher (the ranker, or the GRPO
    policy) into runs/synthesis."""
    from training.stage1_fanout.export import FOLDERS
    from training.stage1_fanout.grpo import run_dir_for
    from training.stage1_fanout.warmstart import FINAL
    from training.stage2_synthesis.synthesis import (
        POLICY_ONNX,
        SYNTHESIS_RUN,
        chosen_backend,
        commit_synthesis,
        synthesize,
    )

    configs = _configs(build)
    run_dir = _run_dir(build, manifest, "synthesis", build.bundle_dir / "runs" / SYNTHESIS_RUN)
    if configs.synthesis.teacher != "folm":  # the ranker: blocks among the student's context
        from training.stage2_synthesis.teachers import CONTEXT, synthesize_blocks

        synthesize_blocks(build.bundle_dir, configs.synthesis.teacher, configs.synthesis,
                          configs.diffusion.model.context or CONTEXT, run_dir)
        return commit_synthesis(build.bundle_dir, configs.synthesis, run_dir)
    policy = _checkpoint(run_dir_for(build.bundle_dir, configs.grpo.reward) / FINAL, "folm")
    local = chosen_backend(configs.synthesis.backend, configs.synthesis.decoding) == "local"
    if local and not (run_dir / POLICY_ONNX).exists():  # it samples the bundle's export
        shutil.copytree(build.bundle_dir / FOLDERS["folm"], run_dir / POLICY_ONNX)
    synthesize(build.bundle_dir, configs.synthesis, policy, run_dir)
    return commit_synthesis(build.bundle_dir, configs.synthesis, run_dir)


def _build_diffusion(build: _Build, manifest: dict[str, Any]) -> dict[str, Any]:
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


BUILDERS: dict[str, Callable[[_Build, dict[str, Any]], dict[str, Any]]] = {
    "catalog": _build_catalog, "lexical": _build_lexical, "benchmark": _build_benchmark,
    "ranker": _build_ranker, "routes": _build_routes,
    "folm-warmstart": _build_warmstart, "folm": _build_folm,
    "synthesis": _build_synthesis, "diffusion": _build_diffusion,
}


def _configs(build: _Build) -> StageConfigs:
    if build.configs is None:
        raise BundleError(f"{build.bundle_dir}: stages 1-3 must be trained, and {NEEDS_TORCH}")
    return build.configs


def _export_policy(build: _Build, checkpoint: Path, name: str,
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


def _run_dir(build: _Build, manifest: dict[str, Any], name: str, run_dir: Path,
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


def _existing(bundle_dir: Path) -> dict[str, Any]:
    try:
        return read_manifest(bundle_dir)
    except BundleError:
        return {}


def check_encoder_dim(config: CatalogConfig) -> None:
    """WordLlama cuts to a Matryoshka dimension; a transformer gives its own width."""
    source_dim = encoder_source(config.encoder).dim
    if source_dim is None and config.dim not in MATRYOSHKA_DIMS:
        raise BundleError(f"--dim {config.dim}: WordLlama's dimensions are {MATRYOSHKA_DIMS}")
    if source_dim is not None and source_dim != config.dim:
        raise BundleError(f"--encoder {config.encoder} gives {source_dim}-d vectors, not "
                          f"--dim {config.dim}")


def recorded_catalog(bundle_dir: Path) -> dict[str, Any]:
    """The catalog config an existing bundle was built with ({} for a new one)."""
    manifest = _existing(Path(bundle_dir))
    return dict(manifest.get("config", {})) if manifest else {}


def catalog_encoder(config: CatalogConfig, staged: Path) -> EncoderConfig:
    """The encoder the catalog is embedded with: WordLlama, or `config.encoder` exported to
    ONNX into the staged bundle's encoder folder (what the service will run)."""
    source = encoder_source(config.encoder)
    if source.folder is None:
        return EncoderConfig(dim=config.dim)
    return export_encoder(source, staged / ENCODER_FOLDER)


def encoder_content(encoder: EncoderConfig) -> dict[str, Any]:
    """What the catalog's vectors are a function of besides its texts: the encoder's name,
    width and, for WordLlama, its package version (its weights ship in the wheel)."""
    content: dict[str, Any] = {"name": encoder.name, "dim": encoder.dim}
    if encoder.folder is None:
        content["version"] = importlib.metadata.version("wordllama")
    return content


def _catalog_key(config: CatalogConfig) -> dict[str, Any]:
    key: dict[str, Any] = {"source": config.source, "dim": config.dim}
    key["index_factory"] = config.index_factory
    if config.encoder != CatalogConfig.encoder:  # a WordLlama bundle keeps its earlier key
        key["encoder"] = source_key(encoder_source(config.encoder))
    if config.source != WORDNET and Path(config.source).is_file():
        key["source_sha256"] = sha256_file(Path(config.source))
    return key


def _benchmark_key(config: CatalogConfig) -> dict[str, Any]:
    key: dict[str, Any] = {"source": config.source, "benchmark": config.benchmark}
    key["seed"] = config.seed
    if config.benchmark and Path(config.benchmark).is_file():
        key["benchmark_sha256"] = sha256_file(Path(config.benchmark))
    return key


def _stage_record(key: dict[str, Any], started: float, **extra: Any) -> dict[str, Any]:
    return {
        "config": key,
        "config_hash": config_hash(key),
        "wall_s": round(time.perf_counter() - started, 2),
        **extra,
    }
