"""Stage 1: one GRPO run of the fan-out LM (`train_grpo`), with TRL's `GRPOTrainer`: its
settings, the loop and the curves it writes; what it optimises, the rewards, is in grpo.py.

On a GPU (`training.device`) the same run trains fp32 weights under bfloat16 autocast with
activation checkpointing, samples through TRL's vLLM engine (colocated) when `vllm` is installed
and the decoding is one regular expression ("lines", "free"), and spreads over every GPU under
`accelerate launch` (docs/gpu.md). `--init` starts from any local HF causal-LM checkpoint
instead of the warm start.

Run directory `models/<bundle>/runs/folm-<reward>/`: config.json, checkpoint-*/ (resumable),
final/ (HF checkpoint), curves.json and curves.png.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from service.artifacts.bundle import git_commit, load_bundle
from service.errors import InputError
from service.fanout.decoding import lines_regex
from service.fanout.format import item_names
from service.fanout.trie import NAME_SCOPES
from service.runtime.encoder import Encoder
from training.device import Device, world_size
from training.stage1_fanout.grpo import (
    TERM_WEIGHTS,
    FanoutScorer,
    GrpoConfig,
    check_decoding,
    reward_functions,
    reward_terms_of,
    run_dir_for,
    training_queries_of,
)


def trl_config(config: GrpoConfig, run_dir: Path, max_new_tokens: int, weights: list[float],
               device: Device, k: int):
    """GRPOConfig: on the CPU the overrides of NOTES.md (fp32, no checkpointing); on a GPU
    fp32 weights under bfloat16 autocast where it computes (an LLM's 1e-6 steps vanish in
    bf16 weights), activation checkpointing and vLLM sampling (`vllm_of`). A step's prompts
    are shared among the processes of an `accelerate launch`."""
    from trl import GRPOConfig

    gpu = device.kind == "cuda"
    return GRPOConfig(
        output_dir=str(run_dir), max_steps=config.steps, learning_rate=config.lr,
        per_device_train_batch_size=per_process_batch(config, world_size()),
        num_generations=config.num_generations, max_completion_length=max_new_tokens,
        temperature=config.temperature, beta=config.beta, reward_weights=weights,
        logging_steps=1, save_steps=config.save_steps, save_total_limit=2, seed=config.seed,
        bf16=device.bf16, fp16=False, activation_checkpointing=gpu, use_cpu=not gpu,
        report_to="none", dataloader_num_workers=0, lr_scheduler_type="constant_with_warmup",
        warmup_steps=config.warmup_steps, disable_tqdm=False, save_only_model=False,
        model_init_kwargs={"dtype": "float32"},
        **vllm_of(config.decoding, device, k),
    )


def per_process_batch(config: GrpoConfig, processes: int) -> int:
    """Each process's share of a step's completions (whole groups of num_generations)."""
    if config.queries_per_step % processes:
        raise InputError(f"{config.queries_per_step} prompts per step do not split over "
                         f"{processes} processes; pass --queries-per-step as a multiple")
    return config.queries_per_step // processes * config.num_generations


def vllm_of(decoding: str, device: Device, k: int) -> dict[str, Any]:
    """TRL's vLLM options: colocated sampling where vLLM runs and the decoding is one regular
    expression for every prompt; "context"/"catalog" (a name tree per prompt) keep HF generate
    with our logits processor."""
    if not device.vllm or decoding in NAME_SCOPES:
        return {}
    regex = lines_regex(k) if decoding == "lines" else None
    # vLLM's share of the GPU: the policy's training state needs most of the rest (docs/gpu.md)
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.2,
            "vllm_structured_outputs_regex": regex}


def train_grpo(
    bundle_dir: Path, config: GrpoConfig, init: Path, run_dir: Path | None = None,
    queries: list[str] | None = None, device: str = "auto",
) -> Path:
    """Run (or resume) GRPO from the checkpoint `init` (the warm start, or any local HF
    causal LM) on `device` (`training.device`); returns final/."""
    import torch
    from datasets import Dataset
    from transformers.trainer_utils import get_last_checkpoint

    from training.device import device_of
    from training.stage1_fanout.grammar import constrain_generation
    from training.stage1_fanout.grpo_trainer import MaskedGRPOTrainer
    from training.stage1_fanout.policy import load_tokenizer, policy_meta, save_policy

    started = time.perf_counter()
    chosen = device_of(device)
    torch.set_num_threads(config.threads)
    run_dir = run_dir or run_dir_for(bundle_dir, config.reward)
    run_dir.mkdir(parents=True, exist_ok=True)
    queries = queries if queries is not None else training_queries_of(bundle_dir, config.reward)
    meta = policy_meta(init)
    policy = meta.get("policy", {})
    check_decoding(config.decoding, int(policy.get("context", 0)))
    tokenizer = load_tokenizer(init)
    bundle = load_bundle(bundle_dir)
    scorer = FanoutScorer(bundle, Encoder(bundle.encoder_config), int(policy.get("k", 10)))
    funcs, weights = reward_functions(scorer, config.reward)
    record = {"stage": "grpo", "config": asdict(config), "init": str(init), "policy": policy,
              "n_training_queries": len(queries),
              "kl": "k3 estimator of reverse KL (TRL), log-probs under the decoding's mask",
              "reward_terms": dict(zip(reward_terms_of(config.reward), weights, strict=True)),
              "seed": config.seed, "git_commit": git_commit(), "device": chosen.record()}
    (run_dir / "config.json").write_text(json.dumps(record, indent=2) + "\n")
    prompts = scorer.prompts(queries, policy)
    data = Dataset.from_dict({"prompt": prompts, "query": queries})
    args = trl_config(config, run_dir, int(policy.get("max_new_tokens", 48)), weights, chosen,
                      scorer.k)
    names = item_names(bundle.items.texts) if config.decoding == "catalog" else ()
    trainer = MaskedGRPOTrainer(model=str(init), reward_funcs=funcs, args=args,
                                train_dataset=data, processing_class=tokenizer)
    trainer.grammar = constrain_generation(trainer.model, tokenizer, scorer.k, config.decoding,
                                           names)
    trainer.train(resume_from_checkpoint=get_last_checkpoint(str(run_dir)))
    if not trainer.accelerator.is_main_process:  # one writer under `accelerate launch`
        return run_dir / "final"
    wall = time.perf_counter() - started
    history = trainer.state.log_history
    write_curves(run_dir, history, reward_terms_of(config.reward))
    steps = trainer.state.global_step
    ledger = {"steps": steps, "completions": steps * config.queries_per_step
              * config.num_generations, "processes": world_size(),
              "wall_s": round(wall, 1)}
    final_meta = {**meta, **record, "wall_s": round(wall, 1), "ledger": ledger}
    save_policy(trainer.accelerator.unwrap_model(trainer.model), tokenizer, run_dir / "final",
                final_meta)
    (run_dir / "config.json").write_text(json.dumps(final_meta, indent=2, default=str) + "\n")
    print(f"GRPO ({config.reward}): {trainer.state.global_step} steps, wall {wall:.0f} s "
          f"-> {run_dir / 'final'}")
    return run_dir / "final"


def write_curves(run_dir: Path, history: list[dict], terms: tuple[str, ...]) -> None:
    """curves.json (per step: reward terms, composite, KL, distinct) and curves.png."""
    keys = {"reward": "reward", "kl": "kl", "composite": "composite",
            "distinct": "distinct_subqueries", "well_formed": "well_formed"}
    keys.update({t: f"score/{t}" for t in TERM_WEIGHTS})
    rows = [h for h in history if "reward" in h]
    curves: dict[str, list] = {"step": [h.get("step") for h in rows]}
    for name, key in keys.items():
        curves[name] = [h.get(key) for h in rows]
    (run_dir / "curves.json").write_text(json.dumps(curves) + "\n")
    plot_curves(curves, run_dir / "curves.png", terms)


def plot_curves(curves: dict[str, list], path: Path, terms: tuple[str, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    steps = curves["step"]
    for name in ("composite", *TERM_WEIGHTS):
        style = "-" if name == "composite" or name in terms else ":"
        axes[0].plot(steps, _smooth(curves.get(name, [])), style, label=name)
    axes[0].set_title(f"reward terms, smoothed\n(trained on {'+'.join(terms)}; dotted: not)",
                      fontsize=10)
    axes[0].legend()
    axes[1].plot(steps, _smooth(curves.get("kl", [])))
    axes[1].set_title("KL to warm start (k3)")
    axes[2].plot(steps, _smooth(curves.get("distinct", [])))
    axes[2].set_title("distinct valid sub-queries / 10")
    for ax in axes:
        ax.set_xlabel("GRPO step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _smooth(values: list, window: int = 10) -> list[float]:
    array = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    if len(array) < window:
        return array.tolist()
    kernel = np.ones(window) / window
    padded = np.concatenate([np.full(window - 1, array[0]), array])
    return np.convolve(padded, kernel, mode="valid").tolist()
