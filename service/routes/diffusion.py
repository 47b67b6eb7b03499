"""The diffusion route: encode → the sampler's context (the query's nearest items, the items
the fan-out prompt names or the ranker's best, as `context_source` in diffusion.json says) →
the exported sampler (whole solver loop in ONNX Runtime; with `draws` D > 1 over the batch
repeated D times, a row that repeats an item replaced from the next draw) → k distinct items
claimed by the rows: among the context, the items the student was trained to choose from, when
the model has one (`resolve_in_context`), else among the whole catalog."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from service.artifacts.bundle import Bundle
from service.artifacts.parts import ItemParts, context_features
from service.errors import BundleError
from service.fanout.candidates import UNRECORDED_SOURCE, Candidates
from service.fanout.grounding import PromptNeighbourhood
from service.ranker.mention_context import MentionContext, MentionedNeighbourhood, one_hot
from service.ranker.mentions import MentionWords
from service.ranker.ranker import RankedNeighbourhood, ScoredCandidates
from service.routes.answer import RouteAnswer, RouteQuery, StageClock, selection_notes, stamp
from service.routes.resolution import (
    first_distinct,
    lead_with_nearest,
    resolve_in_context,
    resolve_items,
)
from service.routes.route import Route
from service.runtime.encoder import Encoder, normalize
from service.runtime.index import neighbour_rows
from service.runtime.sampler import Draw


class Sampler(Protocol):
    """What service.runtime.sampler.DiffusionSampler provides (contract 4)."""

    providers: list[str]
    config: dict
    pointed: bool  # whether a draw holds its rows' weights over the context
    items: np.ndarray | None  # a projected student's item table (M, h)

    def draw(self, query_emb: np.ndarray, seed: int | None = None,
             noise: np.ndarray | None = None, context: np.ndarray | None = None,
             embeddings: np.ndarray | None = None) -> Draw: ...


CONTEXT_SOURCES = ("nearest", "prompt", "ranked", "mentioned")
# what looks a context up by the query's text (all but "nearest", one ANN search)
ContextLookup = PromptNeighbourhood | RankedNeighbourhood | MentionedNeighbourhood


class DiffusionContext:
    """What the served sampler attends to besides the query: C catalog items per query, as
    `context_source` in diffusion.json says: "nearest" (one search), "prompt"
    (`PromptNeighbourhood`), "ranked" (`RankedNeighbourhood`) or "mentioned"
    (`MentionedNeighbourhood`). `scored`: the bundle's ranker, when the assembly built it."""

    def __init__(self, bundle: Bundle, config: dict[str, Any],
                 scored: ScoredCandidates | None = None, items: np.ndarray | None = None) -> None:
        """`items`: a projected student's item table (M, h), whose rows its context leads
        with in place of the items' embeddings."""
        self.bundle, self.n = bundle, int(config.get("context", 0))
        if items is not None and len(items) != len(bundle.items.ids):
            raise BundleError(f"the diffusion model's item table holds {len(items)} items, the "
                              f"catalog {len(bundle.items.ids)}: re-export it (`r4t export "
                              "diffusion`)")
        self.items = items
        self.source = str(config.get("context_source", "nearest"))
        if self.source not in CONTEXT_SOURCES:
            raise BundleError(f"unknown diffusion context source {self.source!r}; "
                              f"use one of {CONTEXT_SOURCES}")
        self.parts = self._parts(bundle, tuple(config.get("parts", ())))
        self.mentions = self._mentions(bundle, config.get("mention_words"), scored)
        self.prompt: ContextLookup | None = None
        if self.n and self.source == "ranked":  # a student distilled from the ranker
            self.prompt = RankedNeighbourhood(scored or ScoredCandidates(bundle), self.n)
        elif self.n and self.source == "mentioned":
            if self.mentions is None:
                raise BundleError("a 'mentioned' context is read with its mention features: "
                                  "diffusion.json lacks `mention_words`")
            self.prompt = MentionedNeighbourhood(self.mentions.features, bundle.index, self.n)
        elif self.n and self.source == "prompt":
            source = str(config.get("candidates", UNRECORDED_SOURCE))
            self.prompt = PromptNeighbourhood(Candidates.of(bundle, source), bundle.items.texts,
                                              bundle.items.embeddings, self.n)

    @staticmethod
    def _mentions(bundle: Bundle, words: dict[str, list[str]] | None,
                  scored: ScoredCandidates | None) -> MentionContext | None:
        """The mention columns the model reads (`mention_words` in diffusion.json: the words
        either side of a mention its encoding tells apart), from the bundle's lexical index."""
        if words is None:
            return None
        if bundle.lexical is None:
            raise BundleError("the diffusion model reads mention features: the bundle needs its "
                              "lexical index (`r4t catalog` builds it)")
        return MentionContext(bundle, MentionWords(tuple(words.get("before", ())),
                                                   tuple(words.get("after", ()))),
                              None if scored is None else scored.features)

    @staticmethod
    def _parts(bundle: Bundle, names: tuple[str, ...]) -> ItemParts | None:
        """The bundle's item parts when the model reads them (the ones it was trained on)."""
        if not names:
            return None
        if bundle.parts is None or bundle.parts.names != names:
            held = None if bundle.parts is None else list(bundle.parts.names)
            raise BundleError(f"the diffusion model reads item parts {list(names)}, the bundle "
                              f"holds {held}: `r4t catalog` rebuilds them")
        return bundle.parts

    def rows(self, texts: Sequence[str], queries: np.ndarray) -> np.ndarray | None:
        """(B, C) catalog rows of the context items, or None without a context."""
        if not self.n:
            return None
        if self.prompt is None:
            return neighbour_rows(self.bundle.index, queries, self.n)
        return self.prompt.rows(texts, queries)  # (B, C)

    def embeddings(self, rows: np.ndarray | None) -> np.ndarray | None:
        """(B, C, d) embeddings of context rows (B, C), or None without a context."""
        if rows is None:
            return None
        return np.ascontiguousarray(self.bundle.items.embeddings[rows], dtype=np.float32)

    def features(self, context: np.ndarray, rows: np.ndarray, queries: np.ndarray,
                 texts: Sequence[str]) -> np.ndarray:
        """(B, C, d [+ P] [+ M]) what the model reads of the context (B, C, d) of rows (B, C)
        of queries `texts` (embeddings `queries`), as it was trained: mention words one-hot."""
        mentions = None if self.mentions is None else one_hot(
            self.mentions(texts, queries, rows, context))
        return context_features(context, self.parts, rows, queries, mentions)

    def served(self, context: np.ndarray, rows: np.ndarray, queries: np.ndarray,
               texts: Sequence[str]) -> np.ndarray:
        """What the exported sampler reads: `features`, or for a projected student its item
        table's rows (B, C, h) [+ P] [+ the compact mention columns, words as ids]."""
        if self.items is None:
            return self.features(context, rows, queries, texts)
        mentions = None if self.mentions is None else self.mentions(texts, queries, rows,
                                                                     context)
        return context_features(self.items[rows], self.parts, rows, queries, mentions)

    def __call__(self, texts: Sequence[str], queries: np.ndarray) -> np.ndarray | None:
        """(B, C, d [+ P]) the sampler's context input, or None without a context."""
        rows = self.rows(texts, queries)
        context = self.embeddings(rows)
        return None if rows is None or context is None else self.features(context, rows, queries,
                                                                          texts)


def repeat_draws(queries: np.ndarray, context: np.ndarray | None,
                 draws: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The sampler's inputs for `draws` blocks per query: each query (B, d) and its context
    (B, C, d) repeated in place, (B·D, d) and (B·D, C, d), so a query's draws are adjacent."""
    repeated = None if context is None else np.repeat(context, draws, axis=0)  # (B·D, C, d)
    return np.repeat(queries, draws, axis=0), repeated  # (B·D, d)


def draw_rows(index: Any, sampler: Sampler, queries: np.ndarray, seed: int | None,
              context: np.ndarray | None, features: np.ndarray | None = None) -> Draw:
    """The sampler's rows (B, L, d) for queries (B, d) (and their weights (B, L, C) when it
    has them). With `draws` D > 1 in its config, D blocks per query come from one run over
    the batch repeated D times, and each query keeps the L rows whose items are the first
    distinct ones, draw after draw (`first_distinct`): a row that repeats an item is replaced
    from the next draw. context: the context's embeddings (B, C, d); features: what the
    sampler reads of it (default: the embeddings)."""
    features = context if features is None else features
    draws = int(sampler.config.get("draws", 1))
    if draws < 1:
        raise BundleError(f"diffusion.json: draws must be at least 1, got {draws}")
    if draws == 1:
        return sampler.draw(queries, seed=seed, context=features, embeddings=context)
    repeated, repeated_features = repeat_draws(queries, features, draws)
    repeated_context = None if context is None else np.repeat(context, draws, axis=0)
    drawn = sampler.draw(repeated, seed=seed, context=repeated_features,
                         embeddings=repeated_context)
    b, length = len(queries), drawn.rows.shape[1]  # (B·D, L, d), each query's draws adjacent
    if drawn.rows.shape[0] != b * draws:
        raise RuntimeError(f"sampler returned {drawn.rows.shape[0]} blocks for {b * draws}")
    rows = drawn.rows.reshape(b, draws * length, -1)  # (B, D·L, d), draw after draw
    weights = None if drawn.weights is None else drawn.weights.reshape(b, draws * length, -1)
    kept = first_distinct(index, rows, length, context, weights)[..., None]  # (B, L, 1)
    return Draw(np.take_along_axis(rows, kept, axis=1),
                None if weights is None else np.take_along_axis(weights, kept, axis=1))


class DiffusionRoute(Route):
    """Query embedding → context → generated rows (B, L, d) → k distinct items they claim."""

    name = "diffusion"

    def __init__(
        self, bundle: Bundle, encoder: Encoder, sampler: Sampler, seed: int | None = None,
        scored: ScoredCandidates | None = None,
    ) -> None:
        """`scored`: the bundle's ranker, built once by the assembly (else loaded here when
        the context needs it)."""
        self.bundle, self.encoder, self.sampler, self.seed = bundle, encoder, sampler, seed
        self.context = DiffusionContext(bundle, sampler.config, scored,
                                        getattr(sampler, "items", None))
        # a mixture head's rows claim the items they point at (`claims` in diffusion.json)
        self.pointers = sampler.config.get("claims", "cosine") == "pointers"
        if self.pointers and not sampler.pointed:
            raise BundleError("diffusion.json says its rows claim what they point at, and its "
                              "sampler returns no weights: re-export it (`r4t export "
                              "diffusion`)")

    @property
    def providers(self) -> list[str]:
        return list(self.sampler.providers)

    def describe(self) -> dict[str, Any]:
        return {"providers": self.providers, "config": self.sampler.config}

    def arm(self) -> None:
        arming = getattr(self.sampler, "arm", None)  # a FaultySampler's (R4T_FAULT_*)
        if arming is not None:
            arming()

    def __call__(self, batch: Sequence[RouteQuery]) -> list[RouteAnswer]:
        clock = StageClock()
        queries = self.encoder.encode([q.text for q in batch])  # (B, d)
        clock.lap("encode")
        context_rows = self.context.rows([q.text for q in batch], queries)  # (B, C) or None
        context = self.context.embeddings(context_rows)  # (B, C, d) or None
        features = None  # (B, C, d [+ P]): the sampler's context
        if context_rows is not None and context is not None:
            features = self.context.served(context, context_rows, queries,
                                           [q.text for q in batch])
            clock.lap("context")
        drawn = draw_rows(self.bundle.index, self.sampler, queries, self.seed, context, features)
        rows = np.asarray(drawn.rows, dtype=np.float32)
        if rows.ndim != 3 or rows.shape[0] != len(batch) or rows.shape[2] != queries.shape[1]:
            raise RuntimeError(f"sampler returned shape {rows.shape}, expected (B, L, d)")
        if not np.isfinite(rows).all():
            raise RuntimeError("sampler returned non-finite rows")
        rows = normalize(rows)  # (B, L, d) unit rows: inner product = cosine
        clock.lap("solver")
        ks, wheres = [q.k for q in batch], [q.where for q in batch]
        if context is None:
            selections, grounded = resolve_items(self.bundle.index, list(rows), queries, ks,
                                                 wheres=wheres)
        else:
            selections, grounded = resolve_in_context(self.bundle.index, rows, context_rows,
                                                      context, queries, ks, wheres,
                                                      drawn.weights if self.pointers else None)
        lead_with_nearest(self.bundle.index, selections, queries, [q.lead for q in batch],
                          wheres)
        clock.lap("search")
        answers = []
        for selection, g, probes in zip(selections, grounded.tolist(), rows, strict=True):
            answers.append(RouteAnswer(selection, g, probes, notes=selection_notes(selection)))
        clock.lap("postprocess")
        return stamp(answers, clock)
