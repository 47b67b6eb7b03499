"""The autoregressive (AR) route: encode → the query's nearest catalog names (the prompt's
context) → the fan-out model (a backend of service/backends/: the ONNX decoder, llama.cpp or an
OpenAI-compatible endpoint) → parse sub-queries → encode → k distinct items claimed by the
sub-queries. A malformed fan-out still yields k items: missing slots come from the query's
dense neighbours, and the answer says so. A query seen before takes its fan-out from the
expansion cache (LRU, per normalised query) instead of the model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from service.artifacts.bundle import Bundle
from service.backends.protocol import FanoutBackend
from service.deadline import latest
from service.fanout.cache import FanoutCache
from service.fanout.candidates import UNRECORDED_SOURCE, Candidates
from service.fanout.format import Generation, PromptBuilder, parse_fanout
from service.fanout.grounding import NameGrounding
from service.routes.answer import RouteAnswer, RouteQuery, StageClock, selection_notes, stamp
from service.routes.resolution import lead_with_nearest, resolve_items
from service.routes.route import Route
from service.runtime.encoder import Encoder


class AutoregressiveRoute(Route):
    """Query → its catalog context → fan-out text → sub-queries → k distinct nearest items."""

    name = "ar"

    def __init__(
        self, bundle: Bundle, encoder: Encoder, backend: FanoutBackend, fanout_k: int,
        context: int = 0, candidates: str = UNRECORDED_SOURCE, cache_size: int = 0,
    ) -> None:
        self.bundle, self.encoder, self.backend, self.fanout_k = bundle, encoder, backend, fanout_k
        self.cache = FanoutCache(cache_size)
        self.prompt_builder = PromptBuilder(Candidates.of(bundle, candidates), bundle.items.texts,
                                            context)
        self.grounding = NameGrounding(bundle.items.texts, bundle.items.embeddings)

    @property
    def providers(self) -> list[str]:
        return list(self.backend.describe().get("providers", [self.backend.name]))

    def close(self) -> None:
        self.backend.close()

    def describe(self) -> dict[str, Any]:
        return {"fanout_k": self.fanout_k, "context": self.prompt_builder.n,
                "candidates": self.prompt_builder.candidates.source,
                "cache_size": self.cache.size,
                **self.backend.describe()}

    def __call__(self, batch: Sequence[RouteQuery]) -> list[RouteAnswer]:
        clock = StageClock()
        texts = [q.text for q in batch]
        queries = self.encoder.encode(texts)  # (B, d)
        clock.lap("encode")
        generations, cached = self._fanouts(texts, queries, clock,
                                            latest(q.deadline for q in batch))
        parsed = [parse_fanout(g.text, self.fanout_k) for g in generations]
        fresh = [i for i, p in enumerate(parsed) if not cached[i] and p.well_formed]
        self.cache.put_many([texts[i] for i in fresh],  # a malformed one is asked again
                            [generations[i] for i in fresh])
        subs = [[s for s, ok in zip(p.subqueries, p.valid, strict=True) if ok] for p in parsed]
        flat = [s for group in subs for s in group]
        clock.lap("postprocess")
        owners = np.repeat(queries, [len(group) for group in subs], axis=0)  # (ΣS, d)
        embedded, _ = self.grounding.probes(flat, owners, self.encoder.encode)  # (ΣS, d)
        clock.lap("encode")
        probes = np.split(embedded, np.cumsum([len(group) for group in subs])[:-1])  # (S_i, d)
        # A malformed fan-out's missing slots come from the query's own dense neighbours.
        caps: list[int | None] = [None if p.well_formed else 1 for p in parsed]
        selections, grounded = resolve_items(self.bundle.index, probes, queries,
                                             [q.k for q in batch], caps,
                                             [q.where for q in batch])
        lead_with_nearest(self.bundle.index, selections, queries, [q.lead for q in batch],
                          [q.where for q in batch])
        clock.lap("search")
        answers = []
        for p, group, found, generation, hit, selection, g in zip(
                parsed, subs, probes, generations, cached, selections, grounded.tolist(),
                strict=True):
            notes = []
            if not p.well_formed:
                notes.append(f"malformed fan-out: {len(group)} of {self.fanout_k} sub-queries "
                             "usable")
            notes += selection_notes(selection)
            if hit:
                notes.append("fan-out from the expansion cache")
            answers.append(RouteAnswer(selection, g, found, notes=notes,
                                      well_formed=p.well_formed, subqueries=group,
                                      tokens=0 if hit else generation.n_tokens, cached=hit))
        clock.lap("postprocess")
        return stamp(answers, clock)

    def _fanouts(self, texts: list[str], queries: np.ndarray, clock: StageClock,
                 deadline: float | None) -> tuple[list[Generation], list[bool]]:
        """Each query's fan-out, from the cache or from the model (prompted for the misses
        only, bounded by the batch's latest deadline), and whether it came from the cache."""
        found = self.cache.get_many(texts)
        missing = [i for i, g in enumerate(found) if g is None]
        if missing:
            prompts = self.prompt_builder.prompts([texts[i] for i in missing], queries[missing])
            clock.lap("context")
            generated = self.backend.generate(prompts, deadline)
            if len(generated) != len(missing):
                raise RuntimeError(f"{len(generated)} completions for {len(missing)} queries")
            clock.lap("decode")
            for i, generation in zip(missing, generated, strict=True):
                found[i] = generation
        fresh = set(missing)
        return [g for g in found if g is not None], [i not in fresh for i in range(len(texts))]
