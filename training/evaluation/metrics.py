"""Set-retrieval metrics of one query: recall/hit over a candidate pool, precision/coverage/Vendi
over the k returned items.

- recall@5k: share of the reference set inside the pool (5,000 distinct candidates; a
  fan-out's probes share them, training.evaluation.baselines.fanout_output);
- hit@5k: share of the reference groups with at least one member inside the pool;
- precision@10: share of the returned items that are in the reference set;
- coverage@10: share of the reference groups reached by the returned items;
- vendi@10: Vendi score of the returned items' embeddings (1 = duplicates, 10 = orthogonal).
"""

from __future__ import annotations

import numpy as np

from service.fanout.reward import vendi_score

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


def set_vendi(embeddings: np.ndarray) -> float:
    """Vendi score of one set of unit vectors, (n, d) → float."""
    return float(vendi_score(embeddings[None])[0])
