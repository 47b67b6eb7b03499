"""Export the trained denoiser and its whole sampler to ONNX, into the bundle folder `diffusion/`.

- `step.onnx`: one guided denoiser evaluation D(x; σ, q) [, context], exported by torch.onnx's
  dynamo exporter (CFG folded in as D = D_c + w·(D_c − D_u)); a mixture head's also returns its
  weights over the context items.
- `sampler.onnx`: the whole solver composed from it (sampler_graph.py): query, [context], noise →
  unit rows, or a mixture head's last weights (the service mixes the rows), in one
  `session.run`. Several draws per query are
  not in the graph: the service runs it over the batch repeated
  (`service.routes.diffusion.draw_rows`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from service.artifacts.bundle import config_hash, read_manifest, stage
from service.errors import BundleError, InputError
from service.runtime.sampler import CONTEXT_INPUT, ROWS_OUTPUT, WEIGHTS_OUTPUT, mixture_rows
from training.stage3_diffusion.denoiser import (
    PRESETS,
    Denoiser,
    DenoiserConfig,
    count_params,
    flops_per_step,
)
from training.stage3_diffusion.sampler_graph import compose_sampler
from training.stage3_diffusion.solvers import sample, solver_evaluations

STAGE = "diffusion"
CFG_FORMULA = "D = D_c + w·(D_c − D_u)"
STEP_INPUTS = ("x", "sigma", "query")


@dataclass(frozen=True)
class ExportConfig:
    """The served schedule, chosen on the val split (`r4t eval --steps-curve`): once the
    denoiser sees the query's neighbourhood and its rows claim items among it, guidance,
    more Euler steps and a second draw buy nothing measurable, and each multiplies the cost."""

    solver: str = "euler"
    steps: int = 1
    cfg_weight: float = 0.0
    form: str = "unrolled"  # "unrolled" or "loop"
    draws: int = 1  # blocks sampled per query; rows that repeat an item come from the next
    parity_batch: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.draws < 1:
            raise InputError(f"draws must be at least 1, got {self.draws}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class GuidedStep(nn.Module):
    """`Denoiser.guided` at a fixed w, as the exported step's forward: x (B,L,d), sigma (B,),
    query (B,d) [, context (B,C,d)] → D (B,L,d), and for a mixture head D's weights
    (B,L,C) over the context items (D = weights @ their embeddings)."""

    def __init__(self, model: Denoiser, cfg_weight: float) -> None:
        super().__init__()
        self.model, self.cfg_weight = model, cfg_weight

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, query: torch.Tensor,
                context: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self.model.config.reads_items or context is None:
            return self.model.guided(x, sigma, query, self.cfg_weight, context)
        weights = self.model.guided_weights(x, sigma, query, self.cfg_weight, context)
        return weights @ context[..., : self.model.config.dim], weights  # (B, L, d), weights


def export_step(model: Denoiser, cfg_weight: float, path: Path) -> onnx.ModelProto:
    """Dynamo export of one guided step with a dynamic batch axis."""
    config = model.config
    batch = torch.export.Dim("batch", min=1)
    example: tuple[torch.Tensor, ...] = (torch.randn(3, config.rows, config.dim),
                                         torch.rand(3) + 0.1, torch.randn(3, config.dim))
    names = list(STEP_INPUTS)
    if config.context:
        example += (torch.randn(3, config.context, config.context_width),)
        names.append(CONTEXT_INPUT)
    program = torch.onnx.export(
        GuidedStep(model, cfg_weight).eval(), example, dynamo=True, optimize=True,
        input_names=names,
        output_names=["denoised", *([WEIGHTS_OUTPUT] if config.reads_items else [])],
        dynamic_shapes=tuple({0: batch} for _ in example), verbose=False,
    )
    program.save(str(path))
    return onnx.load(str(path))


def preset_name(model: Denoiser) -> str:
    return next((name for name, cfg in PRESETS.items() if cfg == model.config), "custom")


def parity(model: Denoiser, sampler: onnx.ModelProto, config: ExportConfig) -> float:
    """Max |ONNX − PyTorch| over a batch of random unit queries with fixed noise (and, for a
    mixture head, max |rows − their weights' mixture|)."""
    import onnxruntime as ort

    rng = np.random.default_rng(config.seed)
    mc = model.config
    query = rng.standard_normal((config.parity_batch, mc.dim)).astype(np.float32)
    query /= np.linalg.norm(query, axis=1, keepdims=True)
    noise = rng.standard_normal((config.parity_batch, mc.rows, mc.dim)).astype(np.float32)
    feeds = {"query": query, "noise": noise}
    context = None
    if mc.context:  # unit rows, like the catalog embeddings served, then cosines
        rows = rng.standard_normal((config.parity_batch, mc.context, mc.dim)).astype(np.float32)
        rows /= np.linalg.norm(rows, axis=-1, keepdims=True)
        cosines = rng.uniform(-1, 1, (config.parity_batch, mc.context, mc.context_width - mc.dim))
        feeds[CONTEXT_INPUT] = np.concatenate([rows, cosines.astype(np.float32)], axis=-1)
        context = torch.from_numpy(feeds[CONTEXT_INPUT])
    session = ort.InferenceSession(sampler.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    if mc.reads_items:  # the graph returns the weights; their mixture is the rows served
        weights = session.run([WEIGHTS_OUTPUT], feeds)[0]  # (B, L, C)
        onnx_rows = mixture_rows(weights, feeds[CONTEXT_INPUT][..., : mc.dim])
    else:
        onnx_rows = session.run([ROWS_OUTPUT], feeds)[0]
    torch_rows = sample(model, torch.from_numpy(query), config.solver, config.steps,
                        config.cfg_weight, noise=torch.from_numpy(noise),
                        context=context).numpy()
    return float(np.abs(onnx_rows - torch_rows).max())


def sampler_evaluations_flops(config: dict[str, Any], solver: str, steps: int) -> tuple[int, int]:
    """(denoiser evaluations, FLOPs) per query of a schedule, from a `diffusion.json` dict."""
    nfe = solver_evaluations(solver, steps)
    guided = float(config["cfg_weight"]) != 0.0
    draws = int(config.get("draws", 1))
    return nfe, draws * nfe * flops_per_step(DenoiserConfig.from_dict(config["model"]),
                                                 cfg=guided)


def sampler_config(model: Denoiser, config: ExportConfig) -> dict[str, Any]:
    """The serving side's `diffusion.json` (everything but the training ledger)."""
    mc = model.config
    nfe = solver_evaluations(config.solver, config.steps)
    return {
        "rows": mc.rows, "k": mc.k, "dim": mc.dim, "context": mc.context,
        "context_source": mc.context_source, "candidates": mc.candidates,
        "parts": list(mc.parts), "context_width": mc.context_width, "solver": config.solver,
        "steps": config.steps, "evaluations": nfe, "form": config.form,
        "cfg_weight": config.cfg_weight, "cfg_formula": CFG_FORMULA,
        "sigma_min": mc.sigma_min, "sigma_max": mc.sigma_max, "sigma_data": mc.sigma_data,
        "schedule": "EDM, rho=7, final sigma 0",
        "output": "weights over the context (rows: their mixture, unit-norm)"
        if mc.reads_items else "unit-norm rows",
        # a mixture head's rows are mixtures of the context: they claim what they point at
        "claims": "pointers" if mc.reads_items else "cosine",
        "params": count_params(model), "preset": preset_name(model),
        "draws": config.draws,
        "flops_per_query": config.draws * nfe * flops_per_step(mc, cfg=config.cfg_weight != 0),
        "sampler_file": "sampler.onnx", "step_file": "step.onnx", "model": mc.to_dict(),
    }


def write_sampler(model: Denoiser, config: ExportConfig, out_dir: Path,
                  served: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write step.onnx, sampler.onnx and diffusion.json (with `served`: what else the service
    needs to build the model's inputs) into `out_dir`; check parity."""
    out_dir.mkdir(parents=True, exist_ok=True)
    mc = model.config
    step = export_step(model, config.cfg_weight, out_dir / "step.onnx")
    sampler = compose_sampler(step, mc.rows, mc.dim, config.solver, config.steps,
                              mc.sigma_min, mc.sigma_max, config.form)
    onnx.save(sampler, str(out_dir / "sampler.onnx"))
    diff = parity(model, sampler, config)
    if not diff < 1e-3:
        raise RuntimeError(f"ONNX sampler differs from PyTorch by {diff:.2e} (limit 1e-3)")
    meta = {**sampler_config(model, config), **(served or {}), "parity_max_abs_diff": diff}
    (out_dir / "diffusion.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def mention_words(bundle_dir: Path) -> dict[str, Any]:
    """The words either side of a mention the student's encoding told apart: the bundle's
    ranker's, which scored its training context (training.stage3_diffusion.context)."""
    from service.ranker.ranker import RANKER_CONFIG, RANKER_DIR, RankerConfig

    path = Path(bundle_dir) / RANKER_DIR / RANKER_CONFIG
    words = RankerConfig.from_dict(json.loads(path.read_text())).words
    return {"mention_words": {"before": list(words.before), "after": list(words.after)}}


def diffusion_stage_config(config: ExportConfig, train_config_hash: str) -> dict[str, Any]:
    """The config the diffusion stage is current by: the export's and the training's hash."""
    return {"export": config.to_dict(), "train_config_hash": train_config_hash}


def export_diffusion(bundle_dir: Path, checkpoint: Path, config: ExportConfig) -> dict[str, Any]:
    """Export the checkpoint's EMA weights and commit `diffusion/` into the bundle."""
    from training.stage3_diffusion.trainer import CURVE_FILE, LOSS_FILE, load_ema

    began = time.perf_counter()
    manifest = read_manifest(bundle_dir)
    model, meta = load_ema(checkpoint)
    stage_config = diffusion_stage_config(config, meta["config_hash"])
    record = {"config": stage_config, "config_hash": config_hash(stage_config),
              "seed": config.seed}
    with stage(bundle_dir, manifest, STAGE, record) as staged:
        sampler_meta = write_sampler(model, config, staged / STAGE,
                                     mention_words(bundle_dir) if model.config.mentions else None)
        training = _training_summary(checkpoint.parent / LOSS_FILE, meta)
        (staged / STAGE / "training.json").write_text(json.dumps(training, indent=2) + "\n")
        files = [f"{STAGE}/{name}" for name in
                 ("step.onnx", "sampler.onnx", "diffusion.json", "training.json")]
        if (checkpoint.parent / CURVE_FILE).is_file():
            shutil.copy(checkpoint.parent / CURVE_FILE, staged / STAGE / CURVE_FILE)
            files.append(f"{STAGE}/{CURVE_FILE}")
        record.update(files=files, wall_s=round(time.perf_counter() - began, 1),
                      sampler={k: v for k, v in sampler_meta.items() if k != "model"},
                      ledger=training.get("ledger", {}))
    return sampler_meta


def _training_summary(loss_file: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The training ledger and curve (from loss.json when present) plus checkpoint metadata."""
    summary = json.loads(loss_file.read_text()) if loss_file.is_file() else {}
    summary.update({"checkpoint_step": meta["step"], "checkpoint_git_commit": meta["git_commit"]})
    summary.setdefault("config", meta["config"])
    summary.setdefault("ledger", {"steps": meta["step"], "wall_s": meta["wall_s"]})
    return summary


def cmd_export_diffusion(args: argparse.Namespace) -> None:
    from training.commands import given
    from training.stage3_diffusion.trainer import CHECKPOINT, RUN_NAME

    checkpoint = args.checkpoint or args.bundle / "runs" / RUN_NAME / CHECKPOINT
    if not checkpoint.is_file():
        raise BundleError(f"no checkpoint at {checkpoint}: run `r4t train diffusion` first")
    config = ExportConfig(**given(args, "solver", "steps", "cfg_weight", "form", "draws",
                                  "parity_batch"))
    meta = export_diffusion(args.bundle, checkpoint, config)
    print(json.dumps({k: v for k, v in meta.items() if k != "model"}, indent=2))
