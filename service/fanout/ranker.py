"""The `ranked` route's chooser: score each candidate (service.fanout.mentions), then pick k
greedily, each pick's score lowered by its redundancy (highest cosine to an item already
picked) times `redundancy`: a set spread over a query's branches, not its best ten.

The scorer is the bundle's `ranker` stage: a LightGBM lambdarank model trained on the labeled
train queries (training/stage1_fanout/ranker.py), or, for a catalog whose benchmark has no
labels, the label-free mention order (an early mention of the query, then similarity).
LightGBM is used as is: a well-kept ranker whose text model file any version reads.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.artifacts.bundle import Bundle, listed_file
from service.errors import BundleError
from service.fanout.mentions import FEATURES, CandidateSizes, MentionFeatures, MentionWords

RANKER_DIR = "ranker"
RANKER_CONFIG = "ranker.json"
RANKER_MODEL = "model.txt"
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

    def __init__(self, config: RankerConfig, booster: Any | None = None) -> None:
        if config.features != FEATURES:
            raise BundleError(f"the ranker was trained on features {list(config.features)}, "
                              f"this service computes {list(FEATURES)}: `r4t --bundle BUNDLE "
                              "catalog` rebuilds it (`make serve` does)")
        self.config, self.booster = config, booster
        self._lock = threading.Lock()  # one LightGBM prediction at a time per model

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
        try:
            import lightgbm
        except OSError as exc:  # its wheel's shared library needs one the system lacks
            raise ImportError(f"lightgbm cannot load its library ({exc}): install the system's "
                              "OpenMP runtime (Debian: libgomp1)") from exc
        # an ImportError leaves the route out, as a missing runtime does
        model = directory / config.model if manifest is None else listed_file(
            directory.parent, manifest, f"{directory.name}/{config.model}")
        return cls(config, lightgbm.Booster(model_file=str(model)))

    def score(self, features: np.ndarray) -> np.ndarray:
        """(C,) higher is better, for features (C, F)."""
        if self.booster is None:
            position = features[:, FEATURES.index("mention_position")]
            similarity = features[:, FEATURES.index("similarity")]
            return -position + LABEL_FREE_WEIGHT * similarity
        with self._lock:
            return np.asarray(self.booster.predict(features, num_threads=1), dtype=np.float64)

    def choose(self, scores: np.ndarray, embeddings: np.ndarray, k: int) -> list[int]:
        """Positions of k candidates (embeddings (C, d) unit rows), picked greedily by score
        minus redundancy × the highest cosine to the picks so far."""
        redundancy = np.zeros(len(scores))  # (C,)
        chosen: list[int] = []
        for _ in range(min(k, len(scores))):
            value = scores - self.config.redundancy * redundancy
            value[chosen] = -np.inf
            best = int(np.argmax(value))
            chosen.append(best)
            redundancy = np.maximum(redundancy, embeddings @ embeddings[best])
        return chosen


class ScoredCandidates:
    """Each query's candidates (service.fanout.mentions) and the bundle's ranker's scores of
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
        tables = [self.features.features(text, query, rows, listed)
                  for text, query, (rows, listed) in zip(texts, queries, found, strict=True)]
        if not tables:
            return []
        scores = self.ranker.score(np.concatenate(tables))  # (ΣC,)
        bounds = np.cumsum([len(t) for t in tables])[:-1]
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

    def __init__(self, bundle: Bundle, n: int) -> None:
        self.scored, self.n = ScoredCandidates(bundle), int(n)

    def rows(self, texts: Sequence[str], queries: np.ndarray) -> np.ndarray:
        return self.scored.best(texts, queries, self.n)  # (Q, n)
