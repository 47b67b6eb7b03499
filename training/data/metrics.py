"""Set-retrieval metrics of one query: recall/hit over a candidate pool, precision/coverage/Vendi
over the k returned items.

- recall@5k: share of the reference set inside the pool (5,000 distinct candidates; a
  fan-out's probes share them, training.evaluation.baselines.fanout_output);
- hit@5k: share of the reference groups with at least one member inside the pool;
- precision@10: share of the returned items that are in the reference set;
- coverage@10: share of the reference groups reached by the returned items;
- hit@1: 1 when the first returned item is the one a narrow query names (its `target`);
- ndcg@10: DCG of the returned list (gain 1 per reference item) over the best list's;
- vendi@10: Vendi score of the returned items' embeddings (1 = duplicates, 10 = orthogonal);
- reach@10: the label ceiling of the candidates a method chose its items from: the coverage@10
  of the best 10 picks among them (a diagnostic that splits a loss between candidate
  generation and selection; never a training signal).
"""

from __future__ import annotations

import numpy as np

POOL_PER_SLOT = 500
SLOTS = 10
POOL_SIZE = POOL_PER_SLOT * SLOTS


def recall(pool: set[str], reference: set[str]) -> float:
    return len(pool & reference) / len(reference) if reference else float("nan")


def group_hit_rate(found: set[str], groups: list[list[str]]) -> float:
    if not groups:
        return float("nan")
    return sum(1 for g in groups if found.intersection(g)) / len(groups)


def precision(returned: list[str], reference: set[str]) -> float:
    if not reference:
        return float("nan")
    return sum(1 for item in returned if item in reference) / len(returned)


def hit_at_1(returned: list[str], target: str | None) -> float:
    if target is None:
        return float("nan")
    return float(bool(returned) and returned[0] == target)


def ndcg(returned: list[str], reference: set[str]) -> float:
    if not reference:
        return float("nan")
    discounts = 1.0 / np.log2(np.arange(2, len(returned) + 2))  # (k,)
    gains = np.array([item in reference for item in returned], dtype=np.float64)  # (k,)
    return float(gains @ discounts / discounts[: min(len(reference), len(returned))].sum())


def set_vendi(embeddings: np.ndarray) -> float:
    """Vendi score of one set of unit vectors, (n, d) → float."""
    return float(vendi_score(embeddings[None])[0])


def standard_error(values: np.ndarray) -> float:
    """Standard error of the mean of finite `values` (0 for fewer than two)."""
    return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0


def best_coverage(candidates: set[str], groups: list[list[str]], k: int = SLOTS) -> float:
    """The coverage of the best k picks among `candidates`: greedy maximum coverage (exact
    when no item sits in two groups, as with disjoint branches)."""
    if not groups:
        return float("nan")
    groups_of: dict[str, set[int]] = {}
    for g, members in enumerate(groups):
        for item in candidates.intersection(members):
            groups_of.setdefault(item, set()).add(g)
    covered: set[int] = set()
    for _ in range(k):
        gain, item = max(((len(gs - covered), item) for item, gs in groups_of.items()),
                         default=(0, None))
        if not gain or item is None:
            break
        covered |= groups_of.pop(item)
    return len(covered) / len(groups)


def vendi_score(vectors: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Vendi score exp(H(eig(K/n))) of each set of unit vectors; K is the cosine kernel.

    vectors: (..., n, d); mask: (..., n) marks the members (default all). Returns (...).
    Identical members give 1, mutually orthogonal members give n.
    """
    x = np.asarray(vectors, dtype=np.float64)
    if mask is None:
        mask = np.ones(x.shape[:-1], dtype=bool)
    x = x * mask[..., None]  # (..., n, d): non-members become zero rows
    count = np.maximum(mask.sum(axis=-1), 1)  # (...)
    kernel = x @ np.swapaxes(x, -1, -2) / count[..., None, None]  # (..., n, n)
    eig = np.clip(np.linalg.eigvalsh(kernel), 0.0, None)  # (..., n)
    entropy = -np.sum(np.where(eig > 1e-12, eig * np.log(np.maximum(eig, 1e-300)), 0.0), axis=-1)
    score = np.exp(entropy)
    return np.where(mask.any(axis=-1), score, 0.0)
