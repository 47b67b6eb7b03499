"""The `ranked` route's chooser: score each candidate (service.ranker.mentions), then pick k
greedily, each score lowered by `redundancy` times its highest cosine to an earlier pick: a
set spread over a query's branches, not its best ten.

The scorer is the `ranker` stage's LightGBM lambdarank model (compiled for serving by
service.ranker.booster), or, without labels, the label-free mention order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.artifacts.bundle import Bundle, listed_file
from service.errors import BundleError
from service.ranker.booster import Booster, load_booster
from service.ranker.mentions import FEATURES, CandidateSizes, MentionFeatures, MentionWords

RANKER_DIR = "ranker"
RANKER_CONFIG = "ranker.json"
RANKER_MODEL = "model.txt"
CHUNK = 256  # queries whose contenders are padded into one array by choose_each
SLACK = 1e-6  # a cosine of unit rows in float32 can pass 1 by rounding
LABEL_FREE_WEIGHT = 5.0  # the label-free order: −position + this × similarity


@dataclass(frozen=True)
class RankerConfig:
    """The served contract of a ranker stage (ranker.json); `model` is None when label-free."""

    sizes: CandidateSizes = field(default_factory=CandidateSizes)
    redundancy: float = 1.0  # λ: a pick's score − λ × its highest cosine to an earlier pick
    features: tuple[str, ...] = FEATURES
    model: str | None = RANKER_MODEL
    words: MentionWords = field(default_factory=MentionWords)  # learned with the model

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "features": list(self.features)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankerConfig:
        words = {side: tuple(found) for side, found in data.get("words", {}).items()}
        return cls(sizes=CandidateSizes(**data.get("sizes", {})),
                   redundancy=float(data.get("redundancy", 1.0)),
                   features=tuple(data.get("features", FEATURES)), model=data.get("model"),
                   words=MentionWords(**words))


class Ranker:
    """Candidate scores from features (C, F), and the greedy set choice over them."""

    def __init__(self, config: RankerConfig, booster: Booster | None = None) -> None:
        if config.features != FEATURES:
            raise BundleError(f"the ranker was trained on features {list(config.features)}, "
                              f"this service computes {list(FEATURES)}: `r4t --bundle BUNDLE "
                              "catalog` rebuilds it (`make serve` does)")
        self.config, self.booster = config, booster

    @classmethod
    def load(cls, directory: Path, manifest: dict[str, Any] | None = None) -> Ranker:
        """The ranker stage in `directory` (a BundleError when it is not there); given the
        bundle's manifest, its model must be a file the manifest lists."""
        path = directory / RANKER_CONFIG
        if not path.is_file():
            raise BundleError(f"bundle has no {RANKER_DIR}/{RANKER_CONFIG}: `r4t --bundle "
                              f"{directory.parent} catalog` builds it")
        config = RankerConfig.from_dict(json.loads(path.read_text()))
        if config.model is None:
            return cls(config)
        model = directory / config.model if manifest is None else listed_file(
            directory.parent, manifest, f"{directory.name}/{config.model}")
        return cls(config, load_booster(model))  # an ImportError leaves the route out

    def score(self, features: np.ndarray) -> np.ndarray:
        """(C,) higher is better, for features (C, F)."""
        if self.booster is None:
            position = features[:, FEATURES.index("mention_position")]
            similarity = features[:, FEATURES.index("similarity")]
            return -position + LABEL_FREE_WEIGHT * similarity
        return self.booster.predict(features)

    def choose(self, scores: np.ndarray, embeddings: np.ndarray, k: int) -> list[int]:
        """Positions of k candidates (embeddings (C, d) unit rows), picked greedily by score
        minus redundancy × the highest cosine to the picks so far."""
        [chosen] = self.choose_each([scores], [np.arange(len(scores))], [k], embeddings)
        return chosen.tolist()

    def choose_each(self, scores: Sequence[np.ndarray], rows: Sequence[np.ndarray],
                    ks: Sequence[int], table: np.ndarray) -> list[np.ndarray]:
        """`choose` for a batch's queries (scores (C,) of rows (C,) of `table`'s unit vectors
        (N, d), each), the greedy steps taken for all of them at once, CHUNK queries at a
        time; only the contenders' vectors are read."""
        out: list[np.ndarray] = []
        for start in range(0, len(scores), CHUNK):
            end = start + CHUNK
            out += self._greedy(scores[start:end], rows[start:end], ks[start:end], table)
        return out

    def _greedy(self, scores: Sequence[np.ndarray], rows: Sequence[np.ndarray],
                ks: Sequence[int], table: np.ndarray) -> list[np.ndarray]:
        """Each query's candidates that can be picked (`contenders`), padded to (B, C), then
        the k greedy steps over the batch."""
        weight = self.config.redundancy
        kept = [contenders(s, min(k, len(s)), weight) for s, k in zip(scores, ks, strict=True)]
        width = max((len(c) for c in kept), default=0)
        value = np.full((len(kept), width), -np.inf)  # (B, C)
        vectors = np.zeros((len(kept), width, table.shape[1]), dtype=np.float32)  # (B, C, d)
        for i, c in enumerate(kept):
            value[i, : len(c)], vectors[i, : len(c)] = scores[i][c], table[rows[i][c]]
        steps = np.array([min(k, len(s)) for s, k in zip(scores, ks, strict=True)])  # (B,)
        redundancy = np.zeros_like(value)  # (B, C)
        chosen = np.zeros((len(kept), int(steps.max(initial=0))), dtype=np.int64)  # (B, k)
        every = np.arange(len(kept))
        for step in range(chosen.shape[1]):
            best = np.argmax(value - weight * redundancy, axis=1)  # (B,)
            chosen[:, step] = best
            value[every, best] = -np.inf
            near = np.matmul(vectors, vectors[every, best][:, :, None])[:, :, 0]  # (B, C)
            redundancy = np.maximum(redundancy, near)
        return [c[chosen[i, : steps[i]]] for i, c in enumerate(kept)]


def contenders(scores: np.ndarray, k: int, weight: float) -> np.ndarray:
    """Positions (ascending) of the candidates a greedy choice of k can pick: a cosine lowers a
    score by at most `weight`, so one scoring below the k-th best minus `weight` never leads."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    floor = np.partition(scores, len(scores) - k)[len(scores) - k] - abs(weight) - SLACK
    return np.flatnonzero(scores >= floor)


class ScoredCandidates:
    """Each query's candidates (service.ranker.mentions) and the bundle's ranker's scores of
    them: what the ranked route chooses from, and the context a student distilled from the
    ranker attends to (`best`)."""

    def __init__(self, bundle: Bundle, ranker: Ranker | None = None,
                 features: MentionFeatures | None = None) -> None:
        """`features`: the bundle's, shared by scorers that differ only in their model or
        redundancy (their per-item caches kept); they must read the ranker's sizes and words."""
        self.ranker = ranker or Ranker.load(bundle.path / RANKER_DIR, bundle.manifest)
        config = self.ranker.config
        if features is None:
            features = MentionFeatures(bundle, config.sizes, config.words)
        elif (features.sizes, features.words) != (config.sizes, config.words):
            raise ValueError("shared mention features must read the ranker's sizes and words")
        self.features = features

    def __call__(self, texts: Sequence[str], queries: np.ndarray
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per query (texts, embeddings (Q, d)): its candidate rows (C,) and scores (C,), the
        batch's rows scored in one call of the model."""
        found = self.features.candidates(texts, queries)
        if not found:
            return []
        scores = self.ranker.score(self.features.table(texts, queries, found))  # (ΣC,)
        bounds = np.cumsum([len(rows) for rows, _ in found])[:-1]
        return [(rows, part) for (rows, _), part in zip(found, np.split(scores, bounds),
                                                         strict=True)]

    def best(self, texts: Sequence[str], queries: np.ndarray, n: int) -> np.ndarray:
        """(Q, n) int64: each query's n best-scored rows, best first; a query with fewer
        candidates repeats them in order (a fixed shape)."""
        out = np.empty((len(texts), n), dtype=np.int64)
        for i, (rows, scores) in enumerate(self(texts, queries)):
            ranked = rows[np.argsort(-scores, kind="stable")]
            out[i] = ranked[np.arange(n) % len(ranked)]
        return out


class RankedNeighbourhood:
    """The n items a ranker-distilled student attends to: the ranker's best n candidates
    (context_source "ranked"), as `PromptNeighbourhood` gives a policy's prompt names."""

    def __init__(self, scored: ScoredCandidates, n: int) -> None:
        self.scored, self.n = scored, int(n)

    def rows(self, texts: Sequence[str], queries: np.ndarray) -> np.ndarray:
        return self.scored.best(texts, queries, self.n)  # (Q, n)
