"""Label-free objectives measured before training: each stage-1 reward (REWARD_MODES),
maximised greedily over the names of the default policy's prompt, scored by coverage@10.

GRPO can at best find the set its reward prefers, so the coverage of that set bounds what
optimising the reward can give, in seconds instead of a training run; `prompt order` (the
first 10 names, what the warm start imitates) is the no-choice reference. This table chose
the default reward on val. Labels score the sets only, never the choice.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.artifacts.bundle import Bundle
from service.fanout.candidates import Candidates
from service.fanout.grounding import PromptNeighbourhood
from service.runtime.encoder import Encoder
from training.data.metrics import SLOTS, group_hit_rate, standard_error
from training.data.splits import BenchmarkQuery
from training.stage1_fanout.grpo import REWARD_MODES, TERM_WEIGHTS, FanoutScorer
from training.stage1_fanout.policy import POLICY_PRESETS
from training.stage1_fanout.reward import reward_terms

PROMPT_ORDER = "prompt order"


def objective(mode: str, query: np.ndarray, sets: np.ndarray, about: np.ndarray) -> np.ndarray:
    """(G,) reward `mode` of G candidate sets of item embeddings (G, n, d) with per-slot
    aboutness (G, n): named items are their own probes (groundedness 1), as under `context`
    decoding; scored over their own n slots."""
    g, n, _ = sets.shape
    terms = reward_terms(query, sets, np.ones((g, n), dtype=bool), np.ones((g, n)), sets,
                         about=about)
    return sum(TERM_WEIGHTS[t] * getattr(terms, t) for t in REWARD_MODES[mode])


def greedy_set(mode: str, query: np.ndarray, items: np.ndarray, about: np.ndarray,
               k: int = SLOTS) -> list[int]:
    """Indices into `items` (n, d) of the k picks that greedily maximise `mode`."""
    chosen: list[int] = []
    for _ in range(min(k, len(items))):
        rest = [i for i in range(len(items)) if i not in chosen]
        picks = np.array([[*chosen, i] for i in rest])  # (G, |S|+1)
        scores = objective(mode, query, items[picks], about[picks])  # (G,)
        chosen.append(rest[int(np.argmax(scores))])  # ties: the earlier name
    return chosen


def objective_rows(bundle: Bundle, queries: list[BenchmarkQuery]) -> list[dict[str, Any]]:
    """Coverage@10 (mean, standard error) of each reward's greedy set and of the prompt order."""
    policy = POLICY_PRESETS["cpu"]
    texts = [q.query for q in queries]
    encoder = Encoder(bundle.encoder_config)
    embedded = encoder.encode(texts)  # (Q, d)
    prompt = PromptNeighbourhood(Candidates.of(bundle, policy.candidates), bundle.items.texts,
                                 bundle.items.embeddings, policy.context)
    rows = prompt.rows(texts, embedded)  # (Q, n)
    about_sets = FanoutScorer(bundle, encoder, SLOTS).about_rows(texts)
    ids = bundle.items.ids
    picks: dict[str, list[np.ndarray]] = {PROMPT_ORDER: [r[:SLOTS] for r in rows]}
    for mode in REWARD_MODES:
        picks[mode] = []
        for row, query, about in zip(rows, embedded, about_sets, strict=True):
            flags = np.array([int(r) in about for r in row])  # (n,)
            picks[mode].append(row[greedy_set(mode, query, bundle.items.embeddings[row], flags)])
    out = []
    for name, chosen in picks.items():
        values = np.array([group_hit_rate({ids[r] for r in c}, q.groups)
                           for c, q in zip(chosen, queries, strict=True)])
        values = values[~np.isnan(values)]
        out.append({"objective": name, "coverage@10": float(values.mean()),
                    "se": standard_error(values),
                    "candidates": f"{policy.candidates} ({policy.context})"})
    return out
