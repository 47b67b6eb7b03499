"""Retrieval methods the evaluation harness can run, by name.

A method maps query texts (and their embeddings) to k probe embeddings per query, k
returned items per query and a candidate pool of 5,000 distinct items per query (a fan-out's
probes share it, POOL_SIZE/k each on average; see `fanout_output`). Served routes are scored
through the service's own route objects (`route_method`): their items are the HTTP answer's.
Baselines here: `single` and `hybrid` (the served routes), `mmr`, `reward-greedy` and
`prompt-names`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from service.artifacts.bundle import Bundle
from service.fanout.candidates import Candidates, candidate_rows
from service.fanout.grounding import PromptNeighbourhood
from service.routes.answer import RouteAnswer, RouteQuery
from service.routes.hybrid import HybridRoute
from service.routes.ranked import RankedRoute
from service.routes.resolution import resolve_items
from service.routes.single import SingleRoute
from service.runtime.encoder import Encoder
from service.runtime.index import search
from training.data.metrics import POOL_PER_SLOT, POOL_SIZE, vendi_score
from training.stage1_fanout.reward import PAPER_WEIGHTS, RewardWeights

MMR_CANDIDATES = 100
MMR_LAMBDA = 0.7


@dataclass
class MethodOutput:
    probes: np.ndarray  # (Q, k, d) what the reward scores: sub-queries, generated rows or items
    items: np.ndarray  # (Q, k) int64 catalog rows returned
    pools: list[np.ndarray]  # per query, the unique catalog rows of the candidate pool
    valid: np.ndarray | None = None  # (Q, k) bool, False for missing/empty/duplicate sub-queries
    union_pools: list[np.ndarray] | None = None  # fan-outs: the paper's union of 500 per probe
    candidates: list[np.ndarray] | None = None  # per query, the rows the method chose from


Method = Callable[[list[str], np.ndarray], MethodOutput]


RouteCall = Callable[[Sequence[RouteQuery]], list[RouteAnswer]]
CandidateLookup = Callable[[list[str], np.ndarray], list[np.ndarray]]
HYBRID_CANDIDATES = 50  # MMR's pool over the hybrid candidates


def answer_probes(answers: list[RouteAnswer], queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per returned item, the probe that claimed it: (Q, k, d) probes and (Q, k) validity.

    A slot the path filled from the query's dense neighbours (slot None), or any slot of a
    malformed fan-out, has the query itself as its probe and is invalid (the reward scores 0).
    """
    k = max(len(a.selection.rows) for a in answers)
    probes = np.repeat(queries[:, None, :], k, axis=1).astype(np.float32)  # (Q, k, d)
    valid = np.zeros((len(answers), k), dtype=bool)
    for i, answer in enumerate(answers):
        for j, slot in enumerate(answer.selection.slots):
            if slot is not None:
                probes[i, j] = answer.probes[slot]
                valid[i, j] = answer.well_formed
    return probes, valid


def route_method(bundle: Bundle, path: RouteCall, k: int,
                candidates: CandidateLookup | None = None) -> Method:
    """A served route as an evaluation method: the path answers, the harness scores;
    `candidates` gives the rows the route chooses among (its reach@10)."""

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        answers = path([RouteQuery(text, k) for text in texts])
        items = np.array([a.selection.rows for a in answers], dtype=np.int64)  # (Q, k)
        probes, valid = answer_probes(answers, queries)  # (Q, k, d), (Q, k)
        out = fanout_output(bundle, probes, items)
        out.valid = valid
        out.candidates = None if candidates is None else candidates(texts, queries)
        return out

    return run


def single(bundle: Bundle, k: int = 10) -> Method:
    """The served `single` route: its top-k returned, top-5000 pooled; probes are the items."""
    path = SingleRoute(bundle, Encoder(bundle.encoder_config))

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        answers = path([RouteQuery(text, k) for text in texts])
        items = np.array([a.selection.rows for a in answers], dtype=np.int64)  # (Q, k)
        _, rows = search(bundle.index, queries, POOL_SIZE)  # (Q, 5000)
        probes = bundle.items.embeddings[items]  # (Q, k, d)
        return MethodOutput(probes=probes, items=items, pools=[r[r >= 0] for r in rows],
                            candidates=list(items))

    return run


def mmr_select(query: np.ndarray, candidates: np.ndarray, k: int, lam: float) -> list[int]:
    """Maximal marginal relevance: argmax λ·sim(q, c) − (1 − λ)·max_s sim(c, s), k times.

    query: (d,), candidates: (C, d) unit rows. Returns positions into `candidates`.
    """
    relevance = candidates @ query  # (C,)
    pairwise = candidates @ candidates.T  # (C, C)
    chosen: list[int] = []
    redundancy = np.full(len(candidates), -np.inf)
    for _ in range(min(k, len(candidates))):
        penalty = np.where(np.isfinite(redundancy), redundancy, 0.0)
        score = lam * relevance - (1.0 - lam) * penalty
        score[chosen] = -np.inf
        best = int(np.argmax(score))
        chosen.append(best)
        redundancy = np.maximum(redundancy, pairwise[best])
    return chosen


def mmr(bundle: Bundle, k: int = 10, lam: float = MMR_LAMBDA) -> Method:
    """MMR over the top-100; the k chosen items are the probes, sharing one pool."""

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        _, rows = search(bundle.index, queries, MMR_CANDIDATES)  # (Q, 100)
        items = np.empty((len(queries), k), dtype=np.int64)
        for i, query in enumerate(queries):
            candidates = rows[i][rows[i] >= 0]
            picked = mmr_select(query, bundle.items.embeddings[candidates], k, lam)
            items[i] = candidates[picked]
        out = fanout_output(bundle, bundle.items.embeddings[items], items)
        out.candidates = [r[r >= 0] for r in rows]
        return out

    return run


def hybrid(bundle: Bundle, k: int = 10) -> Method:
    """The served `hybrid` route: the first k names of a prompt of hybrid candidates (lexical
    and dense fused by rank, no learning), what a fan-out gets without choosing; its
    candidates are the prompt's."""
    path = HybridRoute(bundle, Encoder(bundle.encoder_config))

    def candidates(texts: list[str], queries: np.ndarray) -> list[np.ndarray]:
        return list(path.lookup.rows(texts, queries))

    return route_method(bundle, path, k, candidates)


def mmr_hybrid(bundle: Bundle, k: int = 10, lam: float = MMR_LAMBDA) -> Method:
    """MMR over the hybrid candidates: relevance and diversity, no learning."""

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        pool = candidate_rows(bundle, texts, queries, HYBRID_CANDIDATES, "hybrid")
        items = np.stack([rows[mmr_select(query, bundle.items.embeddings[rows], k, lam)]
                          for rows, query in zip(pool, queries, strict=True)])  # (Q, k)
        out = fanout_output(bundle, bundle.items.embeddings[items], items)
        out.candidates = pool
        return out

    return run


def fanout_output(
    bundle: Bundle, probes: np.ndarray, items: np.ndarray | None = None
) -> MethodOutput:
    """Probes (Q, k, d) → k distinct nearest items and an equal-size candidate pool.

    The pool holds POOL_SIZE (5,000) distinct items, as `single`'s does: the k probes' ranked
    neighbours are interleaved rank by rank, repeats skipped — POOL_SIZE/k per probe on
    average (500 at k=10). The paper's literal union of 500 per probe holds fewer distinct
    items whenever the probes' neighbourhoods overlap (1,700–3,700 of 5,000 in the default
    bundle's test reports), which would score a fan-out on a smaller pool than the single
    query's; it is kept as `union_pools` for the diagnostics.
    """
    q, k, d = probes.shape
    if items is None:
        selections, _ = resolve_items(bundle.index, list(probes), probes[:, 0], [k] * q)
        items = np.array([s.rows for s in selections], dtype=np.int64)  # (Q, k)
    _, rows = search(bundle.index, probes.reshape(q * k, d), POOL_SIZE)  # (Q·k, 5000)
    rows = rows.reshape(q, k, rows.shape[1])  # (Q, k, 5000)
    pools, union = [], []
    for ranked in rows:
        union.append(np.unique(ranked[:, :POOL_PER_SLOT][ranked[:, :POOL_PER_SLOT] >= 0]))
        interleaved = ranked.T.reshape(-1)  # (5000·k,) rank-major: every probe's r-th, then r+1
        interleaved = interleaved[interleaved >= 0]
        _, first = np.unique(interleaved, return_index=True)
        pools.append(interleaved[np.sort(first)][:POOL_SIZE])
    return MethodOutput(probes=probes, items=items, pools=pools, union_pools=union)


def reward_greedy_select(
    query: np.ndarray, candidates: np.ndarray, k: int, weights: RewardWeights = PAPER_WEIGHTS
) -> list[int]:
    """Greedily add the candidate that most raises the composite reward of the chosen set.

    Items as probes are grounded by construction (cos 1 to themselves), so only the diversity
    (normalised Vendi) and alignment terms decide. query: (d,), candidates: (C, d) unit rows.
    """
    relevance = np.clip(candidates @ query, 0.0, 1.0)  # (C,)
    chosen: list[int] = []
    for _ in range(min(k, len(candidates))):
        rest = np.array([c for c in range(len(candidates)) if c not in chosen])  # (R,)
        sets = np.concatenate([np.broadcast_to(candidates[chosen], (len(rest), len(chosen),
                                                                    candidates.shape[1])),
                               candidates[rest][:, None, :]], axis=1)  # (R, m+1, d)
        diversity = (vendi_score(sets) - 1.0) / max(k - 1, 1)  # (R,)
        alignment = (relevance[chosen].sum() + relevance[rest]) / k  # (R,)
        score = weights.diversity * diversity + weights.alignment * alignment
        chosen.append(int(rest[np.argmax(score)]))
    return chosen


def reward_greedy(bundle: Bundle, k: int = 10, candidates: int = MMR_CANDIDATES) -> Method:
    """The reward's greedy optimum over the top-100 items; the k chosen share one pool."""

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        _, rows = search(bundle.index, queries, candidates)  # (Q, C)
        items = np.empty((len(queries), k), dtype=np.int64)
        for i, query in enumerate(queries):
            pool = rows[i][rows[i] >= 0]
            items[i] = pool[reward_greedy_select(query, bundle.items.embeddings[pool], k)]
        out = fanout_output(bundle, bundle.items.embeddings[items], items)
        out.candidates = [r[r >= 0] for r in rows]
        return out

    return run


def prompt_names(bundle: Bundle, k: int = 10, n: int | None = None,
                 source: str = "dense") -> Method:
    """The first k items a prompt of n (default k) names from `source` lists: distinct names,
    the query's own skipped (`service.fanout.grounding.PromptNeighbourhood`), as a policy that
    copied its prompt would return them; the k share one pool, the n are its candidates."""
    lookup = PromptNeighbourhood(Candidates.of(bundle, source), bundle.items.texts,
                                 bundle.items.embeddings, n or k)

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        rows = lookup.rows(texts, queries)  # (Q, n)
        out = fanout_output(bundle, bundle.items.embeddings[rows[:, :k]])
        out.candidates = list(rows)
        return out

    return run


def ranked(bundle: Bundle, k: int = 10) -> Method:
    """The served `ranked` route (the learned ranker over mentions); its candidates are the
    rows it chose from."""
    path = RankedRoute(bundle, Encoder(bundle.encoder_config))

    def candidates(texts: list[str], queries: np.ndarray) -> list[np.ndarray]:
        return [rows for rows, _ in path.features.candidates(texts, queries)]

    return route_method(bundle, path, k, candidates)


BASELINES: dict[str, Callable[..., Method]] = {
    "single": single, "mmr": mmr, "reward-greedy": reward_greedy, "prompt-names": prompt_names,
    "hybrid": hybrid, "hybrid-names": hybrid,  # the route's name in earlier reports
    "mmr-hybrid": mmr_hybrid, "ranked": ranked,
}
