"""Training the stage-3 denoiser on the stage-2 dataset (query embedding → block of k items).

Denoising score matching with EDM's loss weighting and log-normal noise levels, AdamW, EMA,
warm-up then cosine decay, condition dropout for CFG. A denoiser with a context gets per block
the C catalog items the service would look up (`context_source`, context.py). Checkpoints land
in `<bundle>/runs/diffusion/` (a run resumes when its config matches), beside `loss.json` and
`loss_curve.png`; CUDA when torch sees a GPU, all draws from one generator on that device.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from service.artifacts.bundle import config_hash, git_commit
from service.errors import BundleError, InputError
from training.stage3_diffusion.context import BlockDataset, Neighbourhood, bundle_context
from training.stage3_diffusion.denoiser import Denoiser, DenoiserConfig, count_params, preset

RUN_NAME = "diffusion"
CHECKPOINT = "checkpoint.pt"
LOSS_FILE = "loss.json"
CURVE_FILE = "loss_curve.png"
TARGET_ORDERS = ("query", "teacher", "context")


@dataclass(frozen=True)
class TrainConfig:
    model: DenoiserConfig
    steps: int = 5000
    batch: int = 256
    lr: float = 2e-3
    warmup: int = 300
    weight_decay: float = 0.01
    ema_decay: float = 0.999
    p_mean: float = math.log(0.6 / math.sqrt(128))  # EDM's ln σ ~ N(P_mean, P_std²), rescaled
    p_std: float = 1.2
    checkpoint_every: int = 500
    log_every: int = 25
    seed: int = 0
    # an ordered model's row i: "query", the block's i-th item by cosine to the query; "teacher",
    # its i-th as the teacher wrote it (a ranker's pick order, which follows its context's ranks);
    # "context", the block's items in their context's order, so row i copies slot i, i+1, ...
    target_order: str = "query"
    # with mention features: weight of the item scores' cross-entropy against the teacher's
    # scores of the same items (softmax over the context), beside the rows' cross-entropy
    soft_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.target_order not in TARGET_ORDERS:
            raise InputError(f"target_order must be one of {TARGET_ORDERS}, "
                             f"got {self.target_order!r}")
        if self.target_order == "context" and not self.model.context:
            raise InputError("target_order 'context' orders a block by its context: the "
                             "denoiser needs one (context > 0)")

    def to_dict(self) -> dict[str, Any]:
        """As a dict, the model's and the target order's defaults left out (so the hashes of
        runs written before that option existed stay the same)."""
        config = asdict(self) | {"model": self.model.to_dict()}
        if config["target_order"] == "query":
            del config["target_order"]
        if not config["soft_weight"]:
            del config["soft_weight"]
        return config


TRAIN_PRESETS: dict[str, TrainConfig] = {
    "paper": TrainConfig(model=preset("paper"), steps=10_000_000, batch=512, lr=1e-4,
                         warmup=5000, checkpoint_every=1000),
    # fits a CPU build; rows in their context's order copy the teacher's picks more faithfully
    # than in its pick order
    "cpu": TrainConfig(model=preset("cpu"), steps=4500, target_order="context"),
    # trained where its one Euler step samples (σ_max = 1): ln σ ~ N(0, 0.5²); its item
    # scores toward the ranker's scores of the same items; the seed best on val of five
    "standalone": TrainConfig(model=preset("standalone"), steps=2000, target_order="context",
                              p_mean=0.0, p_std=0.5, soft_weight=1.0, seed=4),
    "tiny": TrainConfig(model=preset("tiny"), steps=20, batch=16, warmup=2,
                        checkpoint_every=10, log_every=5),
}


def train_preset(name: str, **overrides: Any) -> TrainConfig:
    if name not in TRAIN_PRESETS:
        raise InputError(f"unknown training preset {name!r}; available: {sorted(TRAIN_PRESETS)}")
    return replace(TRAIN_PRESETS[name], **overrides)


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to 1 over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def rows_from_block(target: torch.Tensor, rows: int, generator: torch.Generator) -> torch.Tensor:
    """(B, k, d) → (B, L, d): L = k as is; L > k appends copies of random items of the block."""
    b, k, _ = target.shape
    if rows == k:
        return target
    extra = torch.randint(0, k, (b, rows - k), generator=generator,
                          device=generator.device)  # (B, L − k)
    return torch.cat([target, torch.gather(target, 1, extra[..., None].expand(-1, -1,
                                                                           target.shape[2]))], 1)


def dsm_loss(model: Denoiser, query: torch.Tensor, target: torch.Tensor,
             config: TrainConfig, generator: torch.Generator,
             context: torch.Tensor | None = None,
             teacher: torch.Tensor | None = None) -> torch.Tensor:
    """EDM loss E_σ λ(σ)‖D(x + σn; σ, q) − x‖², λ = (σ² + σ_d²)/(σ·σ_d)², for query (B, d),
    target rows (B, L, d) and context (B, C, d) or None.

    ln σ ~ N(P_mean, P_std²); the query is replaced by the null condition with p = cond_drop.
    """
    b = target.shape[0]
    device = generator.device
    sigma = torch.exp(config.p_mean + config.p_std * torch.randn(
        b, generator=generator, device=device))  # (B,)
    noise = torch.randn(target.shape, generator=generator, device=device)  # (B, L, d)
    noisy = target + sigma[:, None, None] * noise
    keep = (torch.rand(b, generator=generator, device=device)
            >= config.model.cond_drop).float()  # (B,)
    if config.model.reads_items and context is not None:  # which context item each row is
        logits = model.context_logits(noisy, sigma, query, keep, context)  # (B, L, C)
        items = context[..., : config.model.dim]  # (B, C, d)
        labels = (target @ items.transpose(1, 2)).argmax(dim=-1)  # (B, L)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if config.soft_weight and config.model.mentions and teacher is not None:
            scores = torch.log_softmax(model.item_scores(context), dim=-1)  # (B, C)
            soft = -(torch.softmax(teacher, dim=-1) * scores).sum(-1).mean()
            loss = loss + config.soft_weight * soft
        return loss
    denoised = model(noisy, sigma, query, keep, context)  # (B, L, d)
    sd = config.model.sigma_data
    weight = (sigma**2 + sd**2) / (sigma * sd) ** 2  # (B,)
    per_block = ((denoised - target) ** 2).mean(dim=(1, 2))  # (B,)
    return (weight * per_block).mean()  # = E‖F − F*‖², O(1) by construction


@dataclass
class TrainState:
    model: Denoiser
    ema: Denoiser
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    step: int = 0
    wall_s: float = 0.0
    curve: list[tuple[int, float]] | None = None


def new_state(config: TrainConfig, device: str = "cpu") -> TrainState:
    torch.manual_seed(config.seed)
    model = Denoiser(config.model).to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.99),
                                  weight_decay=config.weight_decay)
    generator = torch.Generator(device).manual_seed(config.seed)
    return TrainState(model, ema, optimizer, generator, curve=[])


def save_checkpoint(state: TrainState, config: TrainConfig, path: Path) -> None:
    """Atomic write (temp file then rename) so an interrupted save leaves the last good one."""
    payload = {
        "config": config.to_dict(), "config_hash": config_hash(config.to_dict()),
        "model": state.model.state_dict(), "ema": state.ema.state_dict(),
        "optimizer": state.optimizer.state_dict(), "generator": state.generator.get_state(),
        "step": state.step, "wall_s": state.wall_s, "curve": state.curve,
        "git_commit": git_commit(), "device": state.generator.device.type,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_state(config: TrainConfig, path: Path, device: str = "cpu") -> TrainState:
    """Resume from `path`; refuse a checkpoint written under another config, or on another
    device (its random stream cannot continue there)."""
    payload = torch.load(path, map_location=device, weights_only=False)
    if stored_config_hash(payload["config"]) != config_hash(config.to_dict()):
        raise BundleError(f"{path} was trained with another config; pass --fresh to restart")
    written = payload.get("device", "cpu")
    if written != torch.device(device).type:
        raise BundleError(f"{path} was trained on {written}, this run is on {device}; pass "
                          "--fresh to restart, or --device " + written)
    state = new_state(config, device)
    state.model.load_state_dict(payload["model"])
    state.ema.load_state_dict(payload["ema"])
    state.optimizer.load_state_dict(payload["optimizer"])
    state.generator.set_state(payload["generator"].cpu())
    state.step, state.wall_s, state.curve = payload["step"], payload["wall_s"], payload["curve"]
    return state


def stored_config_hash(stored: dict[str, Any]) -> str:
    """The hash of a checkpoint's `config` as written today (without the removed options a
    checkpoint of an earlier version still names)."""
    model = DenoiserConfig.from_dict(stored["model"]).to_dict()
    return config_hash({**stored, "model": model})


def load_ema(path: Path) -> tuple[Denoiser, dict[str, Any]]:
    """The EMA weights of a checkpoint, in eval mode, and the checkpoint's metadata."""
    payload = torch.load(path, map_location="cpu", weights_only=False)
    model = Denoiser(DenoiserConfig.from_dict(payload["config"]["model"]))
    model.load_state_dict(payload["ema"])
    meta = {key: payload[key] for key in ("config", "config_hash", "step", "wall_s",
                                          "git_commit")}
    return model.eval(), meta


def train_step(state: TrainState, config: TrainConfig, query: torch.Tensor,
               target: torch.Tensor, context: torch.Tensor | None = None,
               teacher: torch.Tensor | None = None) -> float:
    """One AdamW step on one batch, then the EMA update; returns the batch loss."""
    for group in state.optimizer.param_groups:
        group["lr"] = config.lr * lr_factor(state.step, config.warmup, config.steps)
    state.model.train()
    loss = dsm_loss(state.model, query, target, config, state.generator, context, teacher)
    state.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(state.model.parameters(), 1.0)
    state.optimizer.step()
    decay = min(config.ema_decay, (1 + state.step) / (10 + state.step))  # EMA warm-up
    with torch.no_grad():
        for ema_p, p in zip(state.ema.parameters(), state.model.parameters(), strict=True):
            ema_p.lerp_(p, 1.0 - decay)
    state.step += 1
    return float(loss.detach())


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def batch_of(data: BlockDataset, config: TrainConfig, generator: torch.Generator,
             context: Neighbourhood | None = None) -> Batch:
    """Uniform random blocks (with replacement), on the generator's device: query (B, d),
    target (B, L, d) and, with a neighbourhood, context (B, C, d) and its teacher's scores of
    the context (B, C), when it has them."""
    device = generator.device
    picks = torch.randint(0, len(data.query_emb), (config.batch,), generator=generator,
                          device=device).cpu().numpy()
    query = torch.from_numpy(np.ascontiguousarray(data.query_emb[picks],
                                                  dtype=np.float32)).to(device)
    target = torch.from_numpy(np.ascontiguousarray(data.target_emb[picks],
                                                   dtype=np.float32)).to(device)
    if config.model.ordered and config.target_order == "query":
        target = sorted_by_query(target, query)
    elif config.model.ordered and config.target_order == "context":
        if context is None:
            raise ValueError("target_order 'context' needs the blocks' neighbourhood")
        # the context is in the ranker's order: row i learns to copy a slot from i to i + C − k
        order = context_order(data.target_rows[picks], context.rows[picks])  # (B, k)
        target = torch.gather(target, 1, torch.from_numpy(order).to(device)[..., None]
                              .expand(-1, -1, target.shape[2]))
    rows = rows_from_block(target, config.model.rows, generator)  # (B, L, d)
    if context is None:
        return query, rows, None, None
    return query, rows, context.of(picks, device), context.teacher(picks, device)


def sorted_by_query(target: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """(B, k, d) blocks with their items sorted by cosine to the query (B, d), best first."""
    order = torch.argsort(-(target @ query[:, :, None])[..., 0], dim=1, stable=True)  # (B, k)
    return torch.gather(target, 1, order[..., None].expand(-1, -1, target.shape[2]))


def context_order(target_rows: np.ndarray, context_rows: np.ndarray) -> np.ndarray:
    """(B, k) positions that put each block's catalog rows (B, k) in the order of its context's
    rows (B, C), by the first slot holding each; a block item outside its context is refused
    (only a teacher that chose among that context writes blocks this order fits)."""
    match = target_rows[:, :, None] == context_rows[:, None, :]  # (B, k, C)
    if not match.any(axis=2).all():
        raise BundleError("target_order 'context' needs every block item in its context: "
                          "stage 2 from the ranker teacher among the same context "
                          "(r4t synthesize --teacher ranker)")
    return np.argsort(match.argmax(axis=2), axis=1, kind="stable")


def ledger(state: TrainState, config: TrainConfig, data: BlockDataset) -> dict[str, Any]:
    samples = state.step * config.batch
    return {
        "steps": state.step, "batch": config.batch, "samples_seen": samples,
        "epochs": samples / max(len(data.query_emb), 1), "blocks": len(data.query_emb),
        "wall_s": round(state.wall_s, 1), "params": count_params(state.model),
    }


def train(data: BlockDataset, config: TrainConfig, run_dir: Path, fresh: bool = False,
          progress: bool = True, until: int | None = None,
          context: Neighbourhood | None = None, device: str = "cpu") -> dict[str, Any]:
    """Train (or resume) on `device` to `config.steps` (or stop at step `until` with a
    checkpoint, to resume later); returns the summary also written to loss.json. A model with
    a context needs the blocks' `neighbourhood`."""
    if config.model.context and context is None:
        raise ValueError(f"the model attends to {config.model.context} catalog neighbours: "
                         "pass the blocks' neighbourhood")
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CHECKPOINT
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 weights, TF32 matmuls
    state = load_state(config, path, device) if path.is_file() and not fresh \
        else new_state(config, device)
    window: list[float] = []
    bar = tqdm(total=config.steps, initial=state.step, desc="train diffusion", unit="step",
               disable=not progress)
    last = min(config.steps, until or config.steps)
    while state.step < last:
        began = time.perf_counter()
        query, target, neighbours, teacher = batch_of(data, config, state.generator, context)
        window.append(train_step(state, config, query, target, neighbours, teacher))
        state.wall_s += time.perf_counter() - began
        bar.update(1)
        if state.step % config.log_every == 0 or state.step == last:
            state.curve.append((state.step, float(np.mean(window))))
            bar.set_postfix(loss=f"{state.curve[-1][1]:.4f}")
            window = []
        if state.step % config.checkpoint_every == 0 or state.step == last:
            save_checkpoint(state, config, path)
    bar.close()
    summary = {"config": config.to_dict(), "config_hash": config_hash(config.to_dict()),
               "seed": config.seed, "git_commit": git_commit(), "device": device,
               "ledger": ledger(state, config, data), "curve": state.curve}
    (run_dir / LOSS_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    plot_curve(state.curve or [], run_dir / CURVE_FILE)
    return summary


def plot_curve(curve: list[tuple[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if curve:
        steps, losses = zip(*curve, strict=True)
        ax.plot(steps, losses)
    ax.set_xlabel("step")
    ax.set_ylabel("EDM-weighted DSM loss")
    ax.set_yscale("log")
    ax.set_title("diffusion training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train_on_bundle(bundle_dir: Path, config: TrainConfig, dataset_dir: Path | None = None,
                    run_dir: Path | None = None, fresh: bool = False,
                    device: str = "cpu") -> dict[str, Any]:
    """Train (or resume) on the bundle's stage-2 dataset (default <bundle>/runs/synthesis) into
    `run_dir` (default <bundle>/runs/diffusion), with the context the model attends to."""
    from training.stage2_synthesis.dataset import load_dataset

    dataset_dir = dataset_dir or bundle_dir / "runs" / "synthesis"
    try:
        data = load_dataset(dataset_dir)
    except FileNotFoundError as exc:
        raise BundleError(f"no stage-2 dataset: {exc} (run `r4t synthesize` first)") from exc
    width = int(data.query_emb.shape[1])
    if config.model.dim != width:  # the bundle's encoder decides the width of an item
        config = replace(config, model=replace(config.model, dim=width))
    context = bundle_context(bundle_dir, data, config.model, dataset_dir)
    run_dir = run_dir or bundle_dir / "runs" / RUN_NAME
    return train(data, config, run_dir, fresh=fresh, context=context, device=device)


def cmd_train_diffusion(args: argparse.Namespace) -> None:
    from training.commands import given
    from training.device import device_of

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = given(args, "steps", "batch", "lr", "seed", "target_order")
    model = given(args, "context_source", "context", "layers", "hidden", "mlp", "heads")
    if model:  # DenoiserConfig refuses a bad value with an InputError
        overrides["model"] = replace(train_preset(args.preset).model, **model)
    config = train_preset(args.preset, **overrides)  # the order checked against the model
    run_dir = args.run_dir or args.bundle / "runs" / RUN_NAME
    device = device_of(args.device)
    summary = train_on_bundle(args.bundle, config, args.dataset, run_dir, fresh=args.fresh,
                              device=device.torch)
    print(json.dumps(summary["ledger"], indent=2))
    print(f"checkpoint, loss.json and loss_curve.png in {run_dir}")
