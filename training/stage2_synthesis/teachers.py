"""Stage 2 from a teacher that picks catalog items itself rather than writing sub-queries: the
ranker (`--teacher ranker`), sampled as the policy is, at a temperature; or the labels
(`--teacher oracle`), a positive control for stage 3: blocks of one item per labeled group.

Both choose among the student's context, so the student is trained to pick where it will
pick when served: the ranker's best C candidates (`RankedNeighbourhood`, `context_source =
"ranked"`), or the query's C nearest items (`among = "nearest"`; "mentioned": its nearest
mentions first), each scored by the ranker, for a student that needs no ranker at serve time.
The run folder is `synthesize`'s (shards of query_index, rows, target), so `r4t train diffusion`
reads either unchanged.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from service.artifacts.bundle import Bundle, git_commit, load_bundle
from service.errors import InputError
from service.ranker.mention_context import MentionedNeighbourhood
from service.ranker.ranker import ScoredCandidates
from service.runtime.encoder import Encoder
from service.runtime.index import neighbour_rows
from training.data.splits import disjoint_train, query_texts
from training.stage2_synthesis.dataset import SHARDS, save_shard
from training.stage2_synthesis.synthesis import SynthesisConfig, synthesis_queries

TERMS = ("reward", "ground", "diversity", "alignment")  # not scored here: zeros
# the ranker's best 12: the teacher picks 10 of them, and so does its student (the best 16
# and 24 measured lower on val)
RANKED_CONTEXT = 12
# the student's context: the ranker's best C, the C nearest, the nearest mentions then nearest
AMONG = ("ranked", "nearest", "mentioned")


def ranker_block(scores: np.ndarray, embeddings: np.ndarray, scored: ScoredCandidates, k: int,
                 temperature: float, rng: np.random.Generator) -> list[int]:
    """One sample of the ranker: its spread-out greedy pick over Gumbel-perturbed scores
    (temperature 0: its served answer). Positions into the candidates."""
    noisy = scores + temperature * rng.gumbel(size=len(scores))
    return scored.ranker.choose(noisy, embeddings, k)


def oracle_block(ids: list[str], groups: list[list[str]], k: int,
                 rng: np.random.Generator) -> list[int]:
    """Positions of up to k candidates, one per labeled group in a random order (a random
    member each), then the candidates no group holds, best first."""
    group_of: dict[str, int] = {}
    for g, members in enumerate(groups):
        for item in members:
            group_of.setdefault(item, g)
    members: dict[int, list[int]] = {}
    for position, item in enumerate(ids):
        if item in group_of:
            members.setdefault(group_of[item], []).append(position)
    picks = [int(rng.choice(members[g])) for g in rng.permutation(sorted(members))][:k]
    rest = [p for p in range(len(ids)) if p not in set(picks)]
    return (picks + rest)[:k]


def teacher_queries(bundle: Bundle, bundle_dir: Path, teacher: str, config: SynthesisConfig
                    ) -> tuple[list[str], list[list[list[str]]] | None, list[int]]:
    """(query texts, their groups for the oracle, samples per query): the oracle's are the
    labeled train queries disjoint from val/test; the ranker's, the policy's (train split and
    extra catalog names)."""
    if teacher == "oracle":
        labeled = disjoint_train(bundle_dir)
        return ([q.query for q in labeled], [q.groups for q in labeled],
                [config.samples_per_query] * len(labeled))
    queries = synthesis_queries(bundle, bundle_dir, config)
    n_train = len(query_texts(bundle_dir, "train"))
    return queries, None, [config.samples_per_query if i < n_train else config.extra_samples
                           for i in range(len(queries))]


def context_scored(scored: ScoredCandidates, index: Any, texts: list[str], queries: np.ndarray,
                   n: int, among: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per query, its n context rows (best first: its nearest, or with `among` "mentioned"
    its nearest mentions first) and the ranker's scores of them: each row's features computed
    among the ranker's own candidates, so an item the hybrid list holds keeps its rank there."""
    nearest = neighbour_rows(index, queries, n) if among == "nearest" else \
        MentionedNeighbourhood(scored.features, index, n).rows(texts, queries)  # (Q, n)
    found = scored.features.candidates(texts, queries)
    out = []
    for text, query, near, (rows, listed) in zip(texts, queries, nearest, found, strict=True):
        rows = np.array(list(dict.fromkeys([*rows.tolist(), *near.tolist()])), dtype=np.int64)
        scores = scored.ranker.score(scored.features.features(text, query, rows, listed))
        by_row = dict(zip(rows.tolist(), scores.tolist(), strict=True))
        out.append((near, np.array([by_row[r] for r in near.tolist()])))
    return out


def synthesize_blocks(bundle_dir: Path, teacher: str, config: SynthesisConfig, context: int,
                      run_dir: Path, among: str = "ranked") -> Path:
    """Write `teacher`'s blocks for its queries into `run_dir`; returns it. `among`: the
    student's context the teacher chooses in (AMONG)."""
    if among not in AMONG:
        raise InputError(f"among must be one of {AMONG}, got {among!r}")
    started = time.perf_counter()
    bundle = load_bundle(bundle_dir)
    queries, groups, samples = teacher_queries(bundle, bundle_dir, teacher, config)
    (run_dir / SHARDS).mkdir(parents=True, exist_ok=True)
    query_emb = Encoder(bundle.encoder_config).encode(queries)  # (Q, d)
    np.save(run_dir / "query_emb.npy", query_emb)
    (run_dir / "queries.json").write_text(json.dumps(queries) + "\n")
    scored = ScoredCandidates(bundle)
    rng = np.random.default_rng(config.seed)
    ids, embeddings = bundle.items.ids, bundle.items.embeddings
    arrays: dict[str, list[Any]] = {name: [] for name in ("query_index", "rows", "target", *TERMS)}
    batch = 64
    for start in tqdm(range(0, len(queries), batch), desc=f"{teacher} blocks", unit="batch"):
        texts, vectors = queries[start:start + batch], query_emb[start:start + batch]
        found = scored(texts, vectors) if among == "ranked" else \
            context_scored(scored, bundle.index, texts, vectors, context, among)
        for i, (rows, scores) in enumerate(found, start=start):
            if among == "ranked":
                best = np.argsort(-scores, kind="stable")[:context]
                rows, scores = rows[best], scores[best]  # (C,) the student's context
            served = None  # at T = 0 every sample is the ranker's one answer: chosen once
            if groups is None and config.temperature == 0:
                served = scored.ranker.choose(scores, embeddings[rows], config.k)
            for _ in range(samples[i]):
                if served is not None:
                    picks = served
                elif groups is None:
                    picks = ranker_block(scores, embeddings[rows], scored, config.k,
                                         config.temperature, rng)
                else:
                    picks = oracle_block([ids[r] for r in rows], groups[i], config.k, rng)
                if len(picks) < config.k:
                    continue  # too few candidates for a whole block
                arrays["query_index"].append(np.array([i]))
                arrays["rows"].append(rows[picks][None])
                arrays["target"].append(embeddings[rows[picks]][None])
    kept = len(arrays["query_index"])
    for name in TERMS:
        arrays[name] = [np.zeros(kept, dtype=np.float32)]
    save_shard(run_dir / SHARDS / "shard-00000.npz", arrays, [], config.k, query_emb.shape[1])
    wall = time.perf_counter() - started
    (run_dir / "config.json").write_text(json.dumps({
        "stage": "synthesis", "teacher": teacher, "config": config.__dict__, "context": context,
        "candidates": "ranked", "among": among, "n_queries": len(queries), "seed": config.seed,
        "git_commit": git_commit()}, indent=2) + "\n")
    (run_dir / "ledger.json").write_text(json.dumps({
        "samples": int(sum(samples)), "kept": kept, "dropped": int(sum(samples)) - kept,
        "tokens": 0, "retrieval_calls": 0, "wall_s": round(wall, 1),
        "samples_per_s": round(kept / max(wall, 1e-9), 1)}, indent=2) + "\n")
    print(f"synthesis ({teacher}): {kept:,} blocks for {len(queries):,} queries in {wall:.0f} s "
          f"-> {run_dir}")
    return run_dir
