"""Stage 1: GRPO of the fan-out LM on a label-free set reward, with TRL's `GRPOTrainer`.

Reward functions (one per term, built on `training.stage1_fanout.reward`): the paper's groundedness,
diversity (Vendi) and alignment, weighted 0.6/0.2/0.2 (§2.2, `--reward all`), and aboutness
(`--reward about`, the default: the share of slots whose item the lexical index matches to the
query); GRPO normalises the weighted sum within each group of 8 completions.
KL: TRL's per-token k3 estimator of the reverse KL(π‖π_ref),
exp(r) − r − 1 with r = log π_ref − log π, added to the loss with weight `beta` against the
frozen warm-start policy (the paper's Soft-GRPO used forward and reverse KL; we use reverse).
Both log-probabilities are taken over the tokens the decoding grammar allowed, the distribution
the policy sampled from (training/stage1_fanout/grpo_trainer.py).
Ablations: `--reward ground`, `ground+align` or `all` select which of the paper's terms count;
`--reward ablation` runs the three and writes their report (training/stage1_fanout/ablation.py).

The training loop itself (TRL's settings, the run, its curves) is in grpo_run.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from service.artifacts.bundle import Bundle
from service.errors import InputError
from service.fanout.candidates import UNRECORDED_SOURCE, Candidates
from service.fanout.format import ParsedFanout, PromptBuilder, parse_fanout
from service.fanout.grounding import NameGrounding
from service.runtime.encoder import Encoder
from service.runtime.index import search
from training.commands import given
from training.data.metrics import group_hit_rate
from training.data.splits import masked_train, query_texts
from training.stage1_fanout.reward import PAPER_WEIGHTS, RewardTerms, score_probes

REWARD_MODES: dict[str, tuple[str, ...]] = {
    "ground": ("ground",),
    "ground+align": ("ground", "alignment"),
    "all": ("ground", "diversity", "alignment"),  # the paper's composite
    "about": ("about",),
}  # the label-free rewards (training/evaluation/objectives.py measures each before training)
PAPER_MODES = ("ground", "ground+align", "all")  # `--reward ablation`: which paper terms count
# a positive control, not a recipe: coverage@10 of a labeled train query's groups, val's and
# test's items masked out (`training.data.splits.masked_train`, the ranker's), which GRPO then
# trains on alone; does train coverage climb toward the prompt's label ceiling, does val follow?
LABEL_REWARD = "label"
# `--reward py:module:function`: a user's f(query, item_texts) -> float, the hook the paper's
# authors propose for production signals (click-through proxies); weight 1, one term "user"
USER_REWARD = "py:"
# each term's weight when a reward trains on it: the paper's three at the paper's weights;
# aboutness, not in the paper (weight 0 in PAPER_WEIGHTS), at 1, the only term of its mode
TERM_WEIGHTS = {**asdict(PAPER_WEIGHTS), "about": 1.0}
ABOUT_DEPTH = 100  # an item is about a query when it is among the query's 100 best BM25 matches


@dataclass(frozen=True)
class GrpoConfig:
    preset: str = "cpu"
    # the label-free objective chosen on val (`r4t eval --ceilings`' objective table): "about"
    reward: str = "about"
    # on aboutness GRPO moves the warm start by ±0.002 coverage: few steps keep the default
    # build short on 2 cores
    steps: int = 100
    queries_per_step: int = 4  # prompts per step; completions = queries × num_generations
    num_generations: int = 8  # the paper's group size
    lr: float = 1.5e-4
    beta: float = 0.04  # KL weight against the warm start
    temperature: float = 1.0
    warmup_steps: int = 10
    # sample as served (service/fanout/trie.py DECODINGS): each line one of the prompt's catalog
    # names
    decoding: str = "context"
    save_steps: int = 50
    seed: int = 0
    threads: int = 1


# `--reward ablation`: free-text lines (under `context` decoding every line is a prompt name and
# no collapse can be written); a lower lr with more prompts per step, since a higher lr on fewer
# lowered each run's own reward (Adam turned the noisy gradient into a random walk).
ABLATION: dict[str, dict[str, Any]] = {
    "cpu": {"steps": 100, "lr": 1e-4, "queries_per_step": 16, "decoding": "lines"},
    "tiny": {"decoding": "lines"},
}

GRPO_PRESETS: dict[str, GrpoConfig] = {
    "tiny": GrpoConfig(preset="tiny", steps=1, queries_per_step=2, num_generations=4,
                       save_steps=1, threads=1, lr=1e-2, warmup_steps=0),
    "cpu": GrpoConfig(),
    # A pretrained LLM from --init (docs/gpu.md): free lines, so that it may name what the
    # prompt's 24 neighbours do not (issue 17), sampled by vLLM where installed; an LLM's
    # full fine-tune takes a far smaller step than our 1.4M-parameter policy.
    "gpu": GrpoConfig(preset="gpu", steps=500, queries_per_step=16, lr=1e-6, warmup_steps=20,
                      decoding="lines", save_steps=100, threads=8),
    # the recipe in seconds, from any checkpoint: names from the prompt, which even an
    # untrained one completes (free lines from random weights seldom end)
    "gpu-smoke": GrpoConfig(preset="gpu-smoke", steps=1, queries_per_step=2, num_generations=4,
                            save_steps=1, lr=1e-5, warmup_steps=0),
}


def embed_subqueries(
    encoder: Encoder, grounding: NameGrounding, parsed: list[ParsedFanout], queries: np.ndarray,
    fallback: bool = False,
) -> np.ndarray:
    """(G, k, d) sub-query probes of G fan-outs of queries (G, d): a catalog name is its item
    (service/fanout/grounding.py), other text its embedding; invalid slots are zero, or the query's
    own embedding with `fallback`."""
    k = len(parsed[0].subqueries) if parsed else 0
    probes = np.zeros((len(parsed), k, encoder.dim), dtype=np.float32)  # (G, k, d)
    if fallback:
        probes[:] = queries[:, None, :]
    where = [(g, s) for g, p in enumerate(parsed) for s in range(k) if p.valid[s]]
    if where:
        gi, si = (np.array(a) for a in zip(*where, strict=True))
        texts = [parsed[g].subqueries[s] for g, s in where]
        probes[gi, si], _ = grounding.probes(texts, queries[gi], encoder.encode)  # (n, d)
    return probes


class FanoutScorer:
    """Parse → embed → score completions; memoises the last batch for the three reward fns."""

    def __init__(self, bundle: Bundle, encoder: Encoder, k: int) -> None:
        self.bundle, self.encoder, self.k = bundle, encoder, k
        self.grounding = NameGrounding(bundle.items.texts, bundle.items.embeddings)
        self._query_cache: dict[str, np.ndarray] = {}
        self._about: dict[str, frozenset[int]] = {}
        self._builders: dict[tuple[int, str], PromptBuilder] = {}
        self._last: tuple[tuple[str, ...], RewardTerms, list[ParsedFanout], np.ndarray] | None \
            = None

    def query_embeddings(self, queries: list[str]) -> np.ndarray:
        missing = [q for q in dict.fromkeys(queries) if q not in self._query_cache]
        if missing:
            self._query_cache.update(zip(missing, self.encoder.encode(missing), strict=True))
        return np.stack([self._query_cache[q] for q in queries])  # (G, d)

    def about_rows(self, queries: list[str]) -> list[frozenset[int]]:
        """Per query, the rows whose text the lexical index matches to it (empty without one)."""
        missing = [q for q in dict.fromkeys(queries) if q not in self._about]
        if missing:
            found = (self.bundle.lexical.search(missing, ABOUT_DEPTH) if self.bundle.lexical
                     else [np.zeros(0, dtype=np.int64)] * len(missing))
            self._about.update({q: frozenset(r.tolist()) for q, r in zip(missing, found,
                                                                         strict=True)})
        return [self._about[q] for q in queries]

    def prompts(self, queries: list[str], policy: dict[str, Any]) -> list[str]:
        """The prompts of a policy (its folm.json / config `policy`): each query's `context`
        first catalog names of its `candidates` source."""
        key = (int(policy.get("context", 0)), str(policy.get("candidates", UNRECORDED_SOURCE)))
        if key not in self._builders:
            self._builders[key] = PromptBuilder(Candidates.of(self.bundle, key[1]),
                                                self.bundle.items.texts, key[0])
        return self._builders[key].prompts(queries, self.query_embeddings(queries))

    def score(self, queries: list[str], completions: list[str]) -> tuple[RewardTerms, list]:
        key = (*queries, "\x00", *completions)
        if self._last is not None and self._last[0] == key:
            return self._last[1], self._last[2]
        terms, parsed, _ = self._resolve(key, queries, completions)
        return terms, parsed

    def item_rows(self, queries: list[str], completions: list[str]) -> list[list[int]]:
        """Per completion, the catalog rows its scored slots resolve to (nearest item)."""
        key = (*queries, "\x00", *completions)
        if self._last is not None and self._last[0] == key:
            probes, parsed = self._last[3], self._last[2]
        else:
            _, parsed, probes = self._resolve(key, queries, completions)
        g, k, d = probes.shape  # resolved here only: the built-in rewards never need the rows
        rows = search(self.bundle.index, probes.reshape(g * k, d), 1)[1][:, 0].reshape(g, k)
        return [[int(r) for r, ok in zip(row, p.scored, strict=True) if ok]
                for row, p in zip(rows, parsed, strict=True)]

    def _resolve(self, key: tuple[str, ...], queries: list[str], completions: list[str],
                 ) -> tuple[RewardTerms, list[ParsedFanout], np.ndarray]:
        parsed = [parse_fanout(c, self.k) for c in completions]
        query_emb = self.query_embeddings(queries)  # (G, d)
        probes = embed_subqueries(self.encoder, self.grounding, parsed, query_emb)  # (G, k, d)
        valid = np.stack([p.scored for p in parsed])  # (G, k); > k lines scores 0
        terms = score_probes(self.bundle.index, self.bundle.items.embeddings, query_emb, probes,
                             valid, PAPER_WEIGHTS, self.about_rows(queries))
        self._last = (key, terms, parsed, probes)
        return terms, parsed, probes


def reward_functions(scorer: FanoutScorer, mode: str) -> tuple[list[Callable], list[float]]:
    """TRL reward functions f(prompts, completions, query=..., **kw) -> list[float] + weights."""
    user = mode.startswith(USER_REWARD)
    first = "ground" if user else reward_terms_of(mode)[0]  # the term that logs the rest

    def make(term: str) -> Callable[..., list[float]]:
        def reward(prompts: list[str], completions: list[str], query: list[str],
                   **kwargs: Any) -> list[float]:
            terms, parsed = scorer.score(list(query), list(completions))
            log = kwargs.get("log_metric")
            if log is not None and term == first:  # once per batch
                log("distinct_subqueries", float(np.mean([p.scored.sum() for p in parsed])))
                log("well_formed", float(np.mean([p.well_formed for p in parsed])))
                log("composite", float(terms.total.mean()))
                for name in TERM_WEIGHTS:  # every term, trained on or not (ablations)
                    log(f"score/{name}", float(getattr(terms, name).mean()))
            return [float(v) for v in getattr(terms, term)]

        reward.__name__ = term
        return reward

    if user:
        return [user_reward_function(scorer, user_reward(mode), make("ground"))], [1.0]
    if mode == LABEL_REWARD:
        return [label_reward_function(scorer, labeled_groups(scorer.bundle.path),
                                      make("ground"))], [1.0]
    terms = reward_terms_of(mode)
    return [make(t) for t in terms], [TERM_WEIGHTS[t] for t in terms]


def user_reward(mode: str) -> Callable[[str, list[str]], float]:
    """The callable that `py:module:function` names."""
    module, _, name = mode[len(USER_REWARD):].partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise InputError(f"--reward {mode!r}: cannot load {module}:{name} ({exc})") from exc
    if not callable(function):
        raise InputError(f"--reward {mode!r}: {module}:{name} is not callable")
    return function


def item_reward_function(scorer: FanoutScorer, name: str, score: Callable[[str, list[int]], float],
                         logger: Callable[..., list[float]]) -> Callable[..., list[float]]:
    """TRL reward f(prompts, completions, query=...) named `name`: `score(query, rows)` of the
    catalog rows each completion's slots resolve to; `logger` logs the paper's terms beside it."""

    def reward(prompts: list[str], completions: list[str], query: list[str],
               **kwargs: Any) -> list[float]:
        logger(prompts, completions, query=query, **kwargs)
        rows = scorer.item_rows(list(query), list(completions))
        return [float(score(q, row)) for q, row in zip(query, rows, strict=True)]

    reward.__name__ = name
    return reward


def user_reward_function(scorer: FanoutScorer, function: Callable[[str, list[str]], float],
                         logger: Callable[..., list[float]]) -> Callable[..., list[float]]:
    """The user's score of each completion's items (texts, in slot order)."""
    texts = scorer.bundle.items.texts
    return item_reward_function(scorer, "user",
                                lambda q, rows: function(q, [texts[r] for r in rows]), logger)


def labeled_groups(bundle_dir: Path) -> dict[str, list[list[str]]]:
    """The groups of each labeled train query, held-out items masked, by query text."""
    return {q.query: q.groups for q in masked_train(bundle_dir)}


def label_reward_function(scorer: FanoutScorer, groups: dict[str, list[list[str]]],
                          logger: Callable[..., list[float]]) -> Callable[..., list[float]]:
    """The share of the query's labeled groups its items reach (coverage@10)."""
    ids = scorer.bundle.items.ids
    return item_reward_function(
        scorer, LABEL_REWARD, lambda q, rows: group_hit_rate({ids[r] for r in rows}, groups[q]),
        logger)


def training_queries_of(bundle_dir: Path, mode: str) -> list[str]:
    """What GRPO trains on: the train split's texts, or for the label reward the labeled
    train queries (their held-out items masked: the labels it may read)."""
    if mode == LABEL_REWARD:
        labeled = list(labeled_groups(bundle_dir))
        if not labeled:
            raise InputError(f"--reward {LABEL_REWARD} needs labeled train queries: the "
                             "benchmark's train split has no groups outside val and test")
        return labeled
    return query_texts(bundle_dir, "train")


def reward_terms_of(mode: str) -> tuple[str, ...]:
    """The terms a reward mode trains on."""
    if mode.startswith(USER_REWARD):
        user_reward(mode)
        return ("user",)
    if mode == LABEL_REWARD:
        return (LABEL_REWARD,)
    if mode not in REWARD_MODES:
        raise InputError(f"unknown reward {mode!r}; use one of {sorted(REWARD_MODES)}, "
                         f"{LABEL_REWARD} or "
                         f"{USER_REWARD}module:function")
    return REWARD_MODES[mode]


def run_dir_for(bundle_dir: Path, mode: str) -> Path:
    name = mode.replace("+", "-").replace(":", "-").replace(".", "-")
    return bundle_dir / "runs" / f"folm-{name}"


def policy_fanouts(
    checkpoint: Path, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
    seed: int = 0, k: int = 10, decoding: str = "lines", names: list[str] | None = None,
) -> list[str]:
    """One completion per prompt from a HF checkpoint (sampled; greedy at temperature 0),
    decoded as served (`decoding`; `names` are the catalog's, for "catalog"; k=0: free)."""
    import torch

    from training.stage1_fanout.grammar import constrain_generation
    from training.stage1_fanout.policy import load_policy

    model, tokenizer = load_policy(checkpoint)
    if k:
        constrain_generation(model, tokenizer, k, decoding, names or ())
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} \
        if temperature > 0 else {"do_sample": False}
    texts: list[str] = []
    for start in range(0, len(prompts), 64):
        batch = prompts[start : start + 64]
        enc = tokenizer(batch, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, **sampling)
        texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :],
                                        skip_special_tokens=True)
    return texts


def check_decoding(decoding: str, context: int) -> None:
    """`context` decoding writes the prompt's catalog names: a policy without any cannot."""
    if decoding == "context" and context == 0:
        raise InputError("--decoding context needs a policy with catalog names in its prompt "
                         "(context > 0); use --decoding lines")


def resolve_config(preset: str, **overrides: Any) -> GrpoConfig:
    """The preset with the overrides that are set (not None)."""
    return replace(GRPO_PRESETS[preset], **given(overrides))
