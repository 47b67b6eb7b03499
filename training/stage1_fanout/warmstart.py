"""Warm start of the FOLM: our tiny model knows no language, so it first learns one.

Phase 1, language modelling on the catalog's texts. Phase 2, supervised fan-outs: for each
training query, the prompt carries the names of its `context` nearest catalog items
(service/fanout/format.py) and the target is k of those names sampled without replacement, nearer
names more often (weights exp(−rank/τ)), written in similarity order (topped up from the wider
neighbourhood when the context holds fewer than k).
With no context (policy `context` = 0) the target is sampled from the top `pool` neighbours
instead. The targets use only catalog texts and embeddings — never the evaluation hierarchy —
so the warm start plays the role of the paper's zero-shot baselines: well-formed fan-outs close
to the query, chosen without regard to redundancy; choosing well is stage 1's job.

Training queries: the train split's texts plus `extra_queries` catalog item names chosen at
random, excluding every val/test query text (compared case-insensitively).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from service.artifacts.bundle import git_commit, load_bundle
from service.artifacts.stages import AR_WARMSTART
from service.fanout.candidates import Candidates
from service.fanout.format import build_prompt, context_names, format_fanout, item_names
from service.runtime.encoder import Encoder
from service.runtime.index import search
from training.commands import given
from training.data.splits import query_texts, training_queries
from training.stage1_fanout.policy import (
    EOS,
    POLICY_PRESETS,
    PolicyConfig,
    build_model,
    hf_tokenizer,
    init_embeddings_from_encoder,
    n_params,
    save_policy,
    tokenizer_corpus,
    train_tokenizer,
)

WARMSTART_RUN = AR_WARMSTART
FINAL = "final"


@dataclass(frozen=True)
class WarmStartConfig:
    preset: str = "cpu"
    lm_steps: int = 400
    sft_steps: int = 2000  # the copy skill appears late in SFT
    batch_size: int = 32
    lm_seq_len: int = 64
    lr: float = 2e-3
    pool: int = 40  # neighbours targets are sampled from when the policy has no context
    extra_queries: int = 4000
    ranked: bool = True  # sampled names keep their similarity order (else shuffled)
    # τ of the context names' draw weights exp(−rank/τ); 0 = uniform. Chosen on val by the
    # draws' own coverage@10, over the first k in order and uniform draws
    rank_decay: float = 2.0
    encoder_init: bool = True  # token embeddings start at the retrieval encoder's vectors
    seed: int = 0
    threads: int = 2  # a second thread speeds up the context prompt's SFT


WARMSTART_PRESETS: dict[str, WarmStartConfig] = {
    "tiny": WarmStartConfig(
        preset="tiny", lm_steps=3, sft_steps=3, batch_size=4, lm_seq_len=32, pool=12,
        extra_queries=8, threads=1,
    ),
    "cpu": WarmStartConfig(),
}


def neighbour_names(
    index: Any, names: list[str], query_emb: np.ndarray, pool: int
) -> list[list[str]]:
    """Distinct names of each query's `pool` nearest catalog items, best first."""
    _, rows = search(index, query_emb, pool)  # (Q, pool)
    out = []
    for row in rows:
        seen: dict[str, str] = {}
        for r in row[row >= 0]:
            seen.setdefault(names[r].lower(), names[r])
        out.append(list(seen.values()))
    return out


def target_pool(context: list[str], wider: list[str], k: int) -> list[str]:
    """The context's names, topped up from the wider neighbours when it has fewer than k."""
    if len(context) >= k:
        return context
    listed = {c.lower() for c in context}
    return [*context, *[w for w in wider if w.lower() not in listed]][: max(k, len(context))]


def rank_weights(n: int, decay: float) -> np.ndarray | None:
    """(n,) draw probabilities ∝ exp(−rank/decay) for names listed nearest first; None = uniform."""
    if decay <= 0:
        return None
    w = np.exp(-np.arange(n) / decay)  # (n,)
    return w / w.sum()


def sample_target(
    candidates: list[str], k: int, rng: np.random.Generator, ranked: bool = True,
    decay: float = 0.0,
) -> str:
    """k distinct names drawn without replacement (fewer only if the pool has fewer).

    `decay` > 0 draws nearer names more often (successive draws ∝ exp(−rank/decay)): a uniform
    draw of k of the prompt's context names reaches fewer of a query's branches than the nearest
    ones do. `ranked` keeps them in similarity order (nearest first), which
    ties each line to the query far more predictably than a shuffled order; shuffled targets
    train a policy whose greedy lines ignore the query.
    """
    n = len(candidates)
    picked = rng.choice(n, size=min(k, n), replace=False, p=rank_weights(n, decay))
    order = np.sort(picked) if ranked else picked
    return format_fanout([candidates[i] for i in order])


def lm_batch(
    token_stream: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator
) -> torch.Tensor:
    """Random windows of the concatenated catalog token stream: (B, L) int64."""
    starts = rng.integers(0, len(token_stream) - seq_len - 1, size=batch)
    return torch.from_numpy(np.stack([token_stream[s : s + seq_len] for s in starts]))


def sft_batch(
    tokenizer: Any, prompts: list[str], targets: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+target+eos; labels are -100 outside the target."""
    rows, labels = [], []
    for prompt, target in zip(prompts, targets, strict=True):
        p = tokenizer(prompt)["input_ids"]  # starts with <bos>
        t = tokenizer(target + EOS, add_special_tokens=False)["input_ids"]
        rows.append(p + t)
        labels.append([-100] * len(p) + t)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # (B, L)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)  # (B, L)
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, L)
    for i, (r, la) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(la)] = torch.tensor(la)
        mask[i, : len(r)] = 1
    return ids, mask, lab


def run_phase(
    model: torch.nn.Module, steps: int, lr: float, make_batch: Any, desc: str
) -> list[float]:
    """AdamW with linear warm-up and cosine decay; returns the loss per step."""
    if steps <= 0:
        return []
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + np.cos(np.pi * min(s / steps, 1.0)))
    )
    losses = []
    model.train()
    for _ in (bar := tqdm(range(steps), desc=desc, unit="step")):
        ids, mask, labels = make_batch()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    model.eval()
    return losses


def warm_start(
    bundle_dir: Path, config: WarmStartConfig, run_dir: Path | None = None, force: bool = False
) -> Path:
    """Train tokenizer + LM + supervised fan-outs; returns the HF checkpoint folder."""
    started = time.perf_counter()
    run_dir = run_dir or bundle_dir / "runs" / WARMSTART_RUN
    final = run_dir / FINAL
    if (final / "config.json").is_file() and not force:
        print(f"{final}: warm start exists (use --force to retrain)")
        return final
    torch.set_num_threads(config.threads)
    policy_config: PolicyConfig = POLICY_PRESETS[config.preset]
    bundle = load_bundle(bundle_dir)
    names = item_names(bundle.items.texts)
    queries = training_queries(bundle_dir, names, config.extra_queries, config.seed)
    train_texts = query_texts(bundle_dir, "train")
    raw_tok = train_tokenizer(tokenizer_corpus(bundle.items.texts, train_texts),
                              policy_config.vocab_size)
    tokenizer = hf_tokenizer(raw_tok, policy_config.max_positions)
    model = build_model(policy_config, raw_tok, config.seed)
    encoder = Encoder(bundle.encoder_config)
    if config.encoder_init:
        init_embeddings_from_encoder(model, raw_tok, encoder.encode)
    rng = np.random.default_rng(config.seed)

    eos = raw_tok.token_to_id(EOS)
    stream = np.concatenate([
        np.asarray([*e.ids, eos], dtype=np.int64) for e in raw_tok.encode_batch(bundle.items.texts)
    ])

    def make_lm() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = lm_batch(stream, config.batch_size, config.lm_seq_len, rng)  # (B, L)
        return ids, torch.ones_like(ids), ids

    query_emb = encoder.encode(queries)  # (Q, d)
    n_context = policy_config.context
    candidates = Candidates.of(bundle, policy_config.candidates)
    contexts = context_names(candidates, names, queries, query_emb, n_context)
    wide = neighbour_names(bundle.index, names, query_emb, config.pool)
    neighbours = [target_pool(c, w, policy_config.k) if n_context else w
                  for c, w in zip(contexts, wide, strict=True)]
    decay = config.rank_decay if n_context else 0.0  # τ was chosen for the prompt's context names

    def make_sft() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        picks = rng.integers(0, len(queries), size=config.batch_size)
        prompts = [build_prompt(queries[i], contexts[i]) for i in picks]
        targets = [sample_target(neighbours[i], policy_config.k, rng, config.ranked, decay)
                   for i in picks]
        return sft_batch(tokenizer, prompts, targets)

    lm_losses = run_phase(model, config.lm_steps, config.lr, make_lm, "warm start: LM")
    sft_losses = run_phase(model, config.sft_steps, config.lr, make_sft, "warm start: fan-outs")
    wall = time.perf_counter() - started
    meta = {
        "stage": "warmstart", "config": asdict(config), "policy": asdict(policy_config),
        "params": n_params(model), "n_training_queries": len(queries),
        "n_train_split_queries": len(train_texts), "seed": config.seed,
        "git_commit": git_commit(), "wall_s": round(wall, 1),
        "final_lm_loss": float(np.mean(lm_losses[-20:])) if lm_losses else None,
        "final_sft_loss": float(np.mean(sft_losses[-20:])) if sft_losses else None,
    }
    save_policy(model, tokenizer, final, meta)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    curves = {"lm_loss": lm_losses, "sft_loss": sft_losses}
    (run_dir / "curves.json").write_text(json.dumps(curves) + "\n")
    print(f"warm start: {meta['params']:,} params, {len(queries)} training queries, "
          f"wall {wall:.0f} s -> {final}")
    return final


def resolve_config(preset: str, **overrides: Any) -> WarmStartConfig:
    """The preset with the overrides that are set (not None)."""
    return replace(WARMSTART_PRESETS[preset], **given(overrides))
