"""The composite fan-out reward, vectorised over a group of candidates (numpy only).

R(q, Q) = w_g·groundedness + w_d·diversity + w_a·alignment (paper §2.2), each over the k slots
(diversity: the normalised Vendi score of their top-1 items); `aboutness`, ours, scores what a
slot retrieves against the lexical index. A missing, empty or repeated slot scores 0 on every
term, so malformed candidates score low by construction.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

import numpy as np

from service.runtime.index import VectorIndex, search
from training.data.metrics import vendi_score


@dataclass(frozen=True)
class RewardWeights:
    """Each term's weight in the composite; the defaults are the paper's (PAPER_WEIGHTS)."""

    ground: float = 0.6
    diversity: float = 0.2
    alignment: float = 0.2
    about: float = 0.0  # not in the paper


PAPER_WEIGHTS = RewardWeights()  # §2.2: 0.6 groundedness + 0.2 Vendi + 0.2 alignment


@dataclass
class RewardTerms:
    """Per-candidate terms, each (G,) float64 in [0, 1]."""

    ground: np.ndarray
    diversity: np.ndarray
    alignment: np.ndarray
    about: np.ndarray
    total: np.ndarray
    n_valid: np.ndarray


def reward_terms(
    query: np.ndarray,
    probes: np.ndarray,
    valid: np.ndarray,
    nearest_sim: np.ndarray,
    nearest_emb: np.ndarray,
    weights: RewardWeights = PAPER_WEIGHTS,
    about: np.ndarray | None = None,
) -> RewardTerms:
    """Score G candidates of k probes each.

    query: (d,) or (G, d); probes: (G, k, d); valid: (G, k) bool;
    nearest_sim: (G, k) cosine of each probe to its nearest item; nearest_emb: (G, k, d);
    about: (G, k) bool, each slot's item matched to the query (None: no slot is).
    """
    g, k, _ = probes.shape
    q = np.broadcast_to(np.asarray(query, dtype=np.float64), (g, probes.shape[-1]))  # (G, d)
    valid = np.asarray(valid, dtype=bool)
    ground = (np.clip(nearest_sim, 0.0, 1.0) * valid).sum(axis=1) / k  # (G,)
    cos_q = np.einsum("gkd,gd->gk", probes.astype(np.float64), q)  # (G, k)
    alignment = (np.clip(cos_q, 0.0, 1.0) * valid).sum(axis=1) / k  # (G,)
    vs = vendi_score(nearest_emb, valid)  # (G,)
    diversity = np.clip((vs - 1.0) / max(k - 1, 1), 0.0, 1.0)
    about_share = np.zeros(g) if about is None else (about & valid).sum(axis=1) / k  # (G,)
    total = (weights.ground * ground + weights.diversity * diversity
             + weights.alignment * alignment + weights.about * about_share)
    return RewardTerms(ground, diversity, alignment, about_share, total, valid.sum(axis=1))


def score_probes(
    index: VectorIndex,
    item_embeddings: np.ndarray,
    query: np.ndarray,
    probes: np.ndarray,
    valid: np.ndarray | None = None,
    weights: RewardWeights = PAPER_WEIGHTS,
    about_rows: Sequence[Container[int]] | None = None,
) -> RewardTerms:
    """Resolve each probe to its nearest catalog item, then score. probes: (G, k, d);
    about_rows: per candidate, the rows whose text is about its query (aboutness)."""
    g, k, d = probes.shape
    if valid is None:
        valid = np.ones((g, k), dtype=bool)
    sims, rows = search(index, probes.reshape(g * k, d), 1)  # (G·k, 1)
    nearest = rows[:, 0].reshape(g, k)  # (G, k)
    about = None if about_rows is None else np.array(
        [[int(r) in about_rows[i] for r in nearest[i]] for i in range(g)], dtype=bool)
    return reward_terms(query, probes, valid, sims[:, 0].reshape(g, k),
                        item_embeddings[nearest], weights, about)
