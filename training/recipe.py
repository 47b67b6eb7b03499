"""One `Recipe` per `--preset`: every stage's config a bundle is built with.

The stage modules import torch, so which named preset each stage takes is a torch-free table
here (`RECIPE_PRESETS`: `r4t --help` and a serve-only install read it) and `Recipe.for_preset`
builds the configs from it on demand.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.artifacts.bundle import sha256_file
from service.errors import BundleError, InputError
from training.shipped import ShippedStages
from training.stage1_fanout.gguf import hf_checkpoint

if TYPE_CHECKING:  # stages 1-3 import torch: only when they are built
    from training.stage1_fanout.grpo import GrpoConfig
    from training.stage1_fanout.warmstart import WarmStartConfig
    from training.stage2_synthesis.synthesis import SynthesisConfig
    from training.stage3_diffusion.export import ExportConfig
    from training.stage3_diffusion.trainer import TrainConfig

GPU_DIFFUSION_STEPS = 200_000  # at the paper's batch: many passes over the synthesised blocks
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".json")  # weights, configs, tokenizer
TRAINING_PACKAGES = ("torch", "transformers", "trl", "onnx", "onnxscript")  # the train extra
NEEDS_TORCH = "torch is not installed here (make serve's install): `make bundle` installs it"


@dataclass(frozen=True)
class PresetNames:
    """Which named preset each stage's module gives under one `--preset`: the one mapping."""

    warmstart: str
    grpo: str
    synthesis: str
    diffusion: str
    diffusion_steps: int | None = None  # None: the trainer preset's own
    threads: int = 1  # torch threads of the exports and the denoiser's training
    needs_init: bool = False  # the accelerator recipe (docs/gpu.md) trains an LLM from --init


RECIPE_PRESETS: dict[str, PresetNames] = {
    # the default bundle: its diffusion student reads no ranker at serve time
    "cpu": PresetNames("cpu", "cpu", "cpu", "standalone"),
    "tiny": PresetNames("tiny", "tiny", "tiny", "tiny"),  # tests, seconds
    # the paper's denoiser, for a measured-length run (docs/gpu.md)
    "gpu": PresetNames("cpu", "gpu", "gpu", "paper", diffusion_steps=GPU_DIFFUSION_STEPS,
                       threads=8, needs_init=True),
    "gpu-smoke": PresetNames("tiny", "gpu-smoke", "gpu-smoke", "tiny", needs_init=True),
}
BUNDLE_PRESETS = tuple(RECIPE_PRESETS)


@dataclass(frozen=True)
class Recipe:
    """What stages 1-3 are built with. `Recipe.for_preset("cpu")` is what `r4t train folm`,
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
    # stage 1, the fan-out LM (warm start, GRPO) for the `ar` route: tens of minutes on 2
    # cores; `r4t bundle` builds it for WordNet (its shipped policy is adopted) or with --ar
    ar: bool = True

    @classmethod
    def for_preset(cls, preset: str = "cpu", init: str | Path | None = None) -> Recipe:
        """Every stage's config under `preset` (cpu: the default bundle; tiny: tests, seconds;
        gpu: the accelerator recipe from the LLM `init`, gpu-smoke: the same in seconds)."""
        from training.stage1_fanout.grpo import GRPO_PRESETS
        from training.stage1_fanout.warmstart import WARMSTART_PRESETS
        from training.stage2_synthesis.synthesis import SYNTHESIS_PRESETS
        from training.stage3_diffusion.export import ExportConfig
        from training.stage3_diffusion.trainer import train_preset

        names = _names(preset, init)
        init = _checkpoint(init)
        diffusion = train_preset(names.diffusion)
        if names.diffusion_steps is not None:
            diffusion = replace(diffusion, steps=names.diffusion_steps)
        return cls(warmstart=WARMSTART_PRESETS[names.warmstart], grpo=GRPO_PRESETS[names.grpo],
                   synthesis=SYNTHESIS_PRESETS[names.synthesis], diffusion=diffusion,
                   export=ExportConfig(), threads=names.threads,
                   init=None if init is None else str(Path(init).resolve()))


def _names(preset: str, init: str | Path | None) -> PresetNames:
    """The preset's row, refused before any write when unknown or when it lacks its --init."""
    if preset not in RECIPE_PRESETS:
        raise InputError(f"unknown bundle preset {preset!r}; available: {BUNDLE_PRESETS}")
    if RECIPE_PRESETS[preset].needs_init and init is None:
        raise BundleError(f"the {preset} preset trains a pretrained causal LM: name its local "
                          "checkpoint folder with --init (docs/gpu.md)")
    return RECIPE_PRESETS[preset]


def _checkpoint(init: str | Path | None) -> str | Path | None:
    """The HF checkpoint folder `--init` names (a GGUF file or package is converted first)."""
    if init is not None:
        init = hf_checkpoint(init)
    if init is not None and not (Path(init) / "config.json").is_file():
        raise BundleError(f"--init {init}: no Hugging Face checkpoint there (config.json), "
                          "and no .gguf file or GGUF package")
    return init


def resolve_recipe(presets: str | Recipe) -> tuple[Recipe | None, ShippedStages | None]:
    """Stages 1-3's configs (None where torch is not installed: a serve-only install) and the
    preset's shipped stages, which a build adopts where they match."""
    if isinstance(presets, Recipe):
        return presets, None
    shipped = ShippedStages.for_preset(presets)
    try:
        return Recipe.for_preset(presets), shipped
    except ModuleNotFoundError as exc:
        if exc.name not in TRAINING_PACKAGES:
            raise
        return None, shipped


def init_key(init: Path) -> dict[str, Any]:
    """What the `folm-warmstart` stage of a bundle trained from `init` is current by: the
    checkpoint's place, config and the size and time of each of its files (hashing a 4B
    model's weights at every plan would take a minute), and the prompt it is given."""
    from training.stage1_fanout.policy import foreign_policy

    files = sorted(path for path in init.iterdir() if path.suffix in CHECKPOINT_SUFFIXES)
    return {"init": {"path": str(init), "config_sha256": sha256_file(init / "config.json"),
                     "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]},
            "policy": foreign_policy()}
