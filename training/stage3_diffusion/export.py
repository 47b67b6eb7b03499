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
from service.artifacts.items import EMBEDDINGS_FILE
from service.errors import BundleError, InputError
from service.ranker.mention_context import WORDS
from service.runtime.sampler import (
    CONTEXT_INPUT,
    ITEMS_FILE,
    ROWS_OUTPUT,
    WEIGHTS_OUTPUT,
    mixture_rows,
)
from training.stage3_diffusion.denoiser import (
    PRESETS,
    Denoiser,
    DenoiserConfig,
    count_params,
    flops_per_step,
)
from training.stage3_diffusion.sampler_graph import DENOISED_OUTPUT, compose_sampler
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


class ServedItems(nn.Module):
    """A projected student's first item layer over what the service feeds it per context item:
    its item table's row (the embedding's part of the layer, with the bias: `item_table`),
    the numeric columns through their part, and each side's mention word looked up by id
    (one-hot in training, so its column of the layer)."""

    def __init__(self, model: Denoiser) -> None:
        super().__init__()
        mc, first = model.config, model.item[0]
        weight = first.weight.detach()  # (h, d + N [+ 2·(WORDS + 1)])
        self.hidden, self.words = mc.hidden, (WORDS + 1) if mc.mentions else 0
        numeric = weight.shape[1] - mc.dim - 2 * self.words
        self.register_buffer("numeric", weight[:, mc.dim : mc.dim + numeric].T.clone())  # (N, h)
        self.register_buffer("before", weight[:, mc.dim + numeric :][:, : self.words].T.clone())
        self.register_buffer("after", weight[:, mc.dim + numeric + self.words :].T.clone())

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        """(B, C, h) the first layer's pre-activation for context (B, C, h + N [+ 2])."""
        h, n = self.hidden, self.numeric.shape[0]
        out = context[..., :h] + context[..., h : h + n] @ self.numeric  # (B, C, h)
        if self.words:
            ids = context[..., h + n :].long()  # (B, C, 2)
            out = out + self.before[ids[..., 0]] + self.after[ids[..., 1]]
        return out


class ProjectedStep(nn.Module):
    """A projected student's exported step: its one evaluation's weights over the context
    (B,L,C), reading the context as `ServedItems` does; its rows are their mixture."""

    def __init__(self, model: Denoiser, cfg_weight: float) -> None:
        super().__init__()
        self.model, self.cfg_weight = model, cfg_weight
        self.first, self.rest = ServedItems(model), model.item[1:]

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, query: torch.Tensor,
                context: torch.Tensor) -> torch.Tensor:
        items = self.rest(self.first(context))  # (B, C, h)
        return self.model.guided_weights(x, sigma, query, self.cfg_weight, items=items)


def projects(model: Denoiser, config: ExportConfig) -> bool:
    """Whether the export is projected: a mixture head sampled in one evaluation, so the
    graph needs no embeddings (its one step's weights are its output)."""
    return model.config.reads_items and solver_evaluations(config.solver, config.steps) == 1


def served_width(mc: DenoiserConfig) -> int:
    """A projected student's context width: h, then the numeric columns, then 2 word ids."""
    words = 2 * (WORDS + 1) if mc.mentions else 0
    return mc.hidden + mc.context_width - mc.dim - words + (2 if mc.mentions else 0)


def item_table(model: Denoiser, embeddings: np.ndarray) -> np.ndarray:
    """(M, h) float32: every catalog item's embedding (M, d) through the embedding's part of
    the first item layer, bias included (ITEMS_FILE)."""
    first, dim = model.item[0], model.config.dim
    weight = first.weight.detach().numpy()[:, :dim]  # (h, d)
    table = np.asarray(embeddings, dtype=np.float32) @ weight.T + first.bias.detach().numpy()
    return table.astype(np.float32)


def export_step(model: Denoiser, cfg_weight: float, path: Path,
                projected: bool = False) -> onnx.ModelProto:
    """Dynamo export of one guided step with a dynamic batch axis (`projected`: ProjectedStep's,
    whose one output is the weights)."""
    config = model.config
    batch = torch.export.Dim("batch", min=1)
    example: tuple[torch.Tensor, ...] = (torch.randn(3, config.rows, config.dim),
                                         torch.rand(3) + 0.1, torch.randn(3, config.dim))
    names = list(STEP_INPUTS)
    if config.context:
        width = served_width(config) if projected else config.context_width
        context = torch.randn(3, config.context, width)
        if projected and config.mentions:
            context[..., -2:] = torch.randint(0, WORDS + 1, (3, config.context, 2))
        example += (context,)
        names.append(CONTEXT_INPUT)
    step = ProjectedStep(model, cfg_weight) if projected else GuidedStep(model, cfg_weight)
    outputs = [WEIGHTS_OUTPUT] if projected else \
        [DENOISED_OUTPUT, *([WEIGHTS_OUTPUT] if config.reads_items else [])]
    program = torch.onnx.export(
        step.eval(), example, dynamo=True, optimize=True, input_names=names,
        output_names=outputs, dynamic_shapes=tuple({0: batch} for _ in example), verbose=False,
    )
    program.save(str(path))
    return onnx.load(str(path))


def preset_name(model: Denoiser) -> str:
    return next((name for name, cfg in PRESETS.items() if cfg == model.config), "custom")


def parity(model: Denoiser, sampler: onnx.ModelProto, config: ExportConfig,
           projected: bool = False) -> float:
    """Max |ONNX − PyTorch| over a batch of random unit queries with fixed noise (and, for a
    mixture head, max |rows − their weights' mixture|); a projected sampler reads the same
    context as the service feeds it (its item table's rows, words as ids)."""
    import onnxruntime as ort

    rng = np.random.default_rng(config.seed)
    mc = model.config
    query = rng.standard_normal((config.parity_batch, mc.dim)).astype(np.float32)
    query /= np.linalg.norm(query, axis=1, keepdims=True)
    noise = rng.standard_normal((config.parity_batch, mc.rows, mc.dim)).astype(np.float32)
    feeds = {"query": query, "noise": noise}
    context, embeddings = None, None
    if mc.context:  # unit rows, like the catalog embeddings served, then their columns
        embeddings = rng.standard_normal((config.parity_batch, mc.context, mc.dim))
        embeddings = (embeddings / np.linalg.norm(embeddings, axis=-1, keepdims=True)
                      ).astype(np.float32)
        full, served = parity_context(model, embeddings, rng)
        feeds[CONTEXT_INPUT] = served if projected else full
        context = torch.from_numpy(full)
    session = ort.InferenceSession(sampler.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    if mc.reads_items:  # the graph returns the weights; their mixture is the rows served
        weights = session.run([WEIGHTS_OUTPUT], feeds)[0]  # (B, L, C)
        onnx_rows = mixture_rows(weights, embeddings)
    else:
        onnx_rows = session.run([ROWS_OUTPUT], feeds)[0]
    torch_rows = sample(model, torch.from_numpy(query), config.solver, config.steps,
                        config.cfg_weight, noise=torch.from_numpy(noise),
                        context=context).numpy()
    return float(np.abs(onnx_rows - torch_rows).max())


def parity_context(model: Denoiser, embeddings: np.ndarray, rng: np.random.Generator
                   ) -> tuple[np.ndarray, np.ndarray]:
    """A random context as the model trains on it (B, C, width), and as a projected sampler
    reads it: the embeddings' item-table rows, the same numeric columns, words as ids."""
    mc = model.config
    words = (WORDS + 1) if mc.mentions else 0
    numeric = rng.uniform(-1, 1, (*embeddings.shape[:2], mc.context_width - mc.dim - 2 * words))
    ids = rng.integers(0, WORDS + 1, (*embeddings.shape[:2], 2 if words else 0))
    hot = [np.eye(words, dtype=np.float32)[ids[..., side]] for side in range(2 if words else 0)]
    full = np.concatenate([embeddings, numeric.astype(np.float32), *hot], axis=-1)
    if not mc.reads_items:  # no item layer: the embeddings are the context
        return full.astype(np.float32), full.astype(np.float32)
    table = item_table(model, embeddings.reshape(-1, mc.dim)).reshape(*embeddings.shape[:2], -1)
    served = np.concatenate([table, numeric, ids], axis=-1).astype(np.float32)
    return full.astype(np.float32), served


def sampler_evaluations_flops(config: dict[str, Any], solver: str, steps: int) -> tuple[int, int]:
    """(denoiser evaluations, FLOPs) per query of a schedule, from a `diffusion.json` dict."""
    nfe = solver_evaluations(solver, steps)
    guided = float(config["cfg_weight"]) != 0.0
    draws = int(config.get("draws", 1))
    return nfe, draws * nfe * flops_per_step(DenoiserConfig.from_dict(config["model"]),
                                                 cfg=guided)


def sampler_config(model: Denoiser, config: ExportConfig,
                   projected: bool = False) -> dict[str, Any]:
    """The serving side's `diffusion.json` (everything but the training ledger)."""
    mc = model.config
    nfe = solver_evaluations(config.solver, config.steps)
    return {
        "rows": mc.rows, "k": mc.k, "dim": mc.dim, "context": mc.context,
        "context_source": mc.context_source, "candidates": mc.candidates,
        "parts": list(mc.parts), "solver": config.solver,
        "context_width": served_width(mc) if projected else mc.context_width,
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
        **({"items_file": ITEMS_FILE} if projected else {}),
    }


def write_sampler(model: Denoiser, config: ExportConfig, out_dir: Path,
                  served: dict[str, Any] | None = None,
                  embeddings: np.ndarray | None = None) -> dict[str, Any]:
    """Write step.onnx, sampler.onnx and diffusion.json (with `served`: what else the service
    needs to build the model's inputs) into `out_dir`; check parity. Given the catalog's
    `embeddings`, a mixture head sampled in one evaluation is exported projected (`projects`),
    its item table beside it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    mc = model.config
    projected = embeddings is not None and projects(model, config)
    step = export_step(model, config.cfg_weight, out_dir / "step.onnx", projected)
    sampler = compose_sampler(step, mc.rows, mc.dim, config.solver, config.steps,
                              mc.sigma_min, mc.sigma_max, config.form)
    onnx.save(sampler, str(out_dir / "sampler.onnx"))
    diff = parity(model, sampler, config, projected)
    if not diff < 1e-3:
        raise RuntimeError(f"ONNX sampler differs from PyTorch by {diff:.2e} (limit 1e-3)")
    meta = {**sampler_config(model, config, projected), **(served or {}),
            "parity_max_abs_diff": diff}
    if projected and embeddings is not None:
        np.save(out_dir / ITEMS_FILE, item_table(model, embeddings))
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
                                     mention_words(bundle_dir) if model.config.mentions else None,
                                     np.load(bundle_dir / EMBEDDINGS_FILE, mmap_mode="r")
                                     if projects(model, config) else None)
        training = _training_summary(checkpoint.parent / LOSS_FILE, meta)
        (staged / STAGE / "training.json").write_text(json.dumps(training, indent=2) + "\n")
        files = [f"{STAGE}/{name}" for name in
                 ("step.onnx", "sampler.onnx", "diffusion.json", "training.json",
                  *([ITEMS_FILE] if "items_file" in sampler_meta else []))]
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
