"""The retrieval paths, one object per route. Each takes a batch of queries and returns, per
query, k distinct items, the probes they were resolved from, the content-side groundedness of
those probes and the batch's per-stage timings. Serving, evaluation and the benchmark all call
these objects, so what is measured is what is served.

- single: encode → one top-k search (the floor every other route is compared with);

- diffusion: encode → [its context, when the denoiser attends to one: the query's nearest
  items or the items the fan-out prompt names, as `context_source` in diffusion.json says] →
  the exported sampler (whole solver loop in ONNX Runtime; with `draws` D > 1 over the batch
  repeated D times, a row that repeats an item replaced from the next draw) → nearest item
  per generated row → deduplicate (next-best neighbour on collisions);
- autoregressive: encode → the query's nearest catalog names (the prompt's context) → the
  fan-out model (ONNX decoder with a KV cache, or an OpenAI-compatible endpoint) → parse
  sub-queries → encode → nearest item per sub-query → deduplicate. A
  malformed fan-out still yields k items: missing slots come from the query's dense
  neighbours, and the answer says so.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from service.bundle import Bundle
from service.encoder import Encoder, normalize
from service.errors import BundleError
from service.fanout import Generation, PromptBuilder, parse_fanout
from service.grounding import NameGrounding, PromptNeighbourhood
from service.index import neighbourhood, search
from service.resolution import Selection, first_distinct_rows, resolve_items
from service.trie import DECODINGS, NAME_SCOPES, NameConstraint


@dataclass(frozen=True)
class PathQuery:
    text: str
    k: int


@dataclass
class PathAnswer:
    selection: Selection
    groundedness: float
    probes: np.ndarray  # (P, d) what the items were resolved from; slot i is probes[i]
    timings_s: dict[str, float] = field(default_factory=dict)  # stages of the whole batch
    notes: list[str] = field(default_factory=list)
    well_formed: bool = True  # False: a malformed fan-out (its probes are the usable lines)
    subqueries: list[str] = field(default_factory=list)  # AR: the usable fan-out lines
    tokens: int = 0  # AR: tokens the fan-out model generated for this query


class StageClock:
    """Wall time per named stage, measured lap by lap."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.timings[stage] = self.timings.get(stage, 0.0) + now - self._last
        self._last = now


class Sampler(Protocol):
    """What service.sampler.DiffusionSampler provides (contract 4)."""

    providers: list[str]
    config: dict

    def sample(self, query_emb: np.ndarray, seed: int | None = None,
               noise: np.ndarray | None = None,
               context: np.ndarray | None = None) -> np.ndarray: ...


class FanoutBackend(Protocol):
    """Writes one fan-out completion per prompt (text in service.fanout's format)."""

    name: str

    def generate(self, prompts: list[str]) -> list[Generation]: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def stamp(answers: list[PathAnswer], clock: StageClock) -> list[PathAnswer]:
    """Give every answer of a batch the batch's stage timings."""
    for answer in answers:
        answer.timings_s = clock.timings
    return answers


class SinglePath:
    """Query embedding → its k nearest items: one dense query, the floor of every route."""

    name = "single"

    def __init__(self, bundle: Bundle, encoder: Encoder) -> None:
        self.bundle, self.encoder = bundle, encoder
        self.providers = ["faiss"]

    def describe(self) -> dict[str, Any]:
        return {"providers": self.providers, "index": type(self.bundle.index).__name__}

    def __call__(self, batch: Sequence[PathQuery]) -> list[PathAnswer]:
        clock = StageClock()
        queries = self.encoder.encode([q.text for q in batch])  # (B, d)
        clock.lap("encode")
        scores, rows = search(self.bundle.index, queries, max(q.k for q in batch))  # (B, k)
        clock.lap("search")
        answers = []
        for query, probe, found, score in zip(batch, queries, rows, scores, strict=True):
            keep = found[: query.k] >= 0
            selection = Selection(found[: query.k][keep].tolist(),
                                  score[: query.k][keep].tolist(), [0] * int(keep.sum()))
            grounded = float(np.clip(score[0], 0.0, 1.0)) if len(score) else 0.0
            answers.append(PathAnswer(selection, grounded, probe[None]))  # (1, d) probe
        clock.lap("postprocess")
        return stamp(answers, clock)


CONTEXT_SOURCES = ("nearest", "prompt")


class DiffusionContext:
    """What the served sampler attends to besides the query: the embeddings (B, C, d) of C
    catalog items per query, or None when its model has no context. The source is recorded at
    export (`context_source` in diffusion.json): "nearest", the query's C nearest items (one
    search), or "prompt", the C items the fan-out prompt names (`PromptNeighbourhood`)."""

    def __init__(self, bundle: Bundle, config: dict[str, Any]) -> None:
        self.bundle, self.n = bundle, int(config.get("context", 0))
        self.source = str(config.get("context_source", "nearest"))
        if self.source not in CONTEXT_SOURCES:
            raise BundleError(f"unknown diffusion context source {self.source!r}; "
                              f"use one of {CONTEXT_SOURCES}")
        self.prompt: PromptNeighbourhood | None = None
        if self.n and self.source == "prompt":
            self.prompt = PromptNeighbourhood(bundle.index, bundle.items.texts,
                                              bundle.items.embeddings, self.n)

    def __call__(self, texts: Sequence[str], queries: np.ndarray) -> np.ndarray | None:
        if not self.n:
            return None
        if self.prompt is None:
            return neighbourhood(self.bundle.index, self.bundle.items.embeddings, queries, self.n)
        rows = self.prompt.rows(texts, queries)  # (B, C)
        return np.ascontiguousarray(self.bundle.items.embeddings[rows], dtype=np.float32)


def repeat_draws(queries: np.ndarray, context: np.ndarray | None,
                 draws: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The sampler's inputs for `draws` blocks per query: each query (B, d) and its context
    (B, C, d) repeated in place, (B·D, d) and (B·D, C, d), so a query's draws are adjacent."""
    repeated = None if context is None else np.repeat(context, draws, axis=0)  # (B·D, C, d)
    return np.repeat(queries, draws, axis=0), repeated  # (B·D, d)


def draw_rows(index: Any, sampler: Sampler, queries: np.ndarray, seed: int | None,
              context: np.ndarray | None) -> np.ndarray:
    """The sampler's rows (B, L, d) for queries (B, d). With `draws` D > 1 in its config, D
    blocks per query come from one run over the batch repeated D times, and each query keeps
    the L rows whose items are the first distinct ones, draw after draw
    (`first_distinct_rows`): a row that repeats an item is replaced from the next draw."""
    draws = int(sampler.config.get("draws", 1))
    if draws < 1:
        raise BundleError(f"diffusion.json: draws must be at least 1, got {draws}")
    if draws == 1:
        return sampler.sample(queries, seed=seed, context=context)
    repeated, repeated_context = repeat_draws(queries, context, draws)
    rows = sampler.sample(repeated, seed=seed, context=repeated_context)
    b, length = len(queries), rows.shape[1]  # rows (B·D, L, d), each query's draws adjacent
    if rows.shape[0] != b * draws:
        raise RuntimeError(f"sampler returned {rows.shape[0]} blocks for {b * draws}")
    rows = rows.reshape(b, draws * length, rows.shape[2])  # (B, D·L, d), draw after draw
    return first_distinct_rows(index, rows, length, context)


class DiffusionPath:
    """Query embedding → generated rows (B, L, d) → k distinct nearest items."""

    name = "diffusion"

    def __init__(
        self, bundle: Bundle, encoder: Encoder, sampler: Sampler, seed: int | None = None
    ) -> None:
        self.bundle, self.encoder, self.sampler, self.seed = bundle, encoder, sampler, seed
        self.context = DiffusionContext(bundle, sampler.config)

    @property
    def providers(self) -> list[str]:
        return list(self.sampler.providers)

    def describe(self) -> dict[str, Any]:
        return {"providers": self.providers, "config": self.sampler.config}

    def __call__(self, batch: Sequence[PathQuery]) -> list[PathAnswer]:
        clock = StageClock()
        queries = self.encoder.encode([q.text for q in batch])  # (B, d)
        clock.lap("encode")
        context = self.context([q.text for q in batch], queries)  # (B, C, d) or None
        if context is not None:
            clock.lap("search")
        rows = np.asarray(draw_rows(self.bundle.index, self.sampler, queries, self.seed,
                                    context), dtype=np.float32)
        if rows.ndim != 3 or rows.shape[0] != len(batch) or rows.shape[2] != queries.shape[1]:
            raise RuntimeError(f"sampler returned shape {rows.shape}, expected (B, L, d)")
        if not np.isfinite(rows).all():
            raise RuntimeError("sampler returned non-finite rows")
        rows = normalize(rows)  # (B, L, d) unit rows: inner product = cosine
        clock.lap("solver")
        selections, grounded = resolve_items(self.bundle.index, list(rows), queries,
                                             [q.k for q in batch])
        clock.lap("search")
        answers = []
        for selection, g, probes in zip(selections, grounded.tolist(), rows, strict=True):
            notes = [f"{selection.filled} slots filled from the query's dense neighbours"]
            answers.append(PathAnswer(selection, g, probes, notes=notes if selection.filled
                                      else []))
        clock.lap("postprocess")
        return stamp(answers, clock)


class OnnxFanoutBackend:
    """The bundle's fan-out model decoded by service.decoding.FanoutDecoder.

    `decoding` (service/trie.py DECODINGS): "free", "lines" (exactly k non-empty lines),
    "context" (each line a name from the prompt's catalog line) or "catalog" (any item name,
    from `catalog_names`); None = what the model was trained under (folm.json, else "lines").
    """

    name = "onnx"

    def __init__(
        self, decoder: Any, temperature: float | None, max_new_tokens: int, seed: int | None,
        decoding: str | None = None, catalog_names: Sequence[str] = (),
    ) -> None:
        if temperature is None:
            temperature = float(decoder.config.get("temperature", 0.0))
        decoding = decoding or str(decoder.config.get("decoding", "lines"))
        if decoding not in DECODINGS:
            raise BundleError(f"unknown fan-out decoding {decoding!r}; use one of {DECODINGS}")
        self.decoder, self.temperature, self.decoding = decoder, temperature, decoding
        self.max_new_tokens, self.seed = max_new_tokens, seed
        self.names = NameConstraint(decoder.tokenizer, int(decoder.config["eos_id"]), decoding,
                                    catalog_names) if decoding in NAME_SCOPES else None

    def generate(self, prompts: list[str]) -> list[Generation]:
        return self.decoder.generate(
            prompts, temperature=self.temperature, max_new_tokens=self.max_new_tokens,
            seed=self.seed, enforce_lines=self.decoding != "free", names=self.names,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name, "providers": list(self.decoder.providers),
            "temperature": self.temperature, "max_new_tokens": self.max_new_tokens,
            "decoding": self.decoding, "config": self.decoder.config,
        }

    def close(self) -> None:
        return None


class AutoregressivePath:
    """Query → its catalog context → fan-out text → sub-queries → k distinct nearest items."""

    name = "ar"

    def __init__(
        self, bundle: Bundle, encoder: Encoder, backend: FanoutBackend, fanout_k: int,
        context: int = 0,
    ) -> None:
        self.bundle, self.encoder, self.backend, self.fanout_k = bundle, encoder, backend, fanout_k
        self.prompt_builder = PromptBuilder(bundle.index, bundle.items.texts, context)
        self.grounding = NameGrounding(bundle.items.texts, bundle.items.embeddings)

    @property
    def providers(self) -> list[str]:
        return list(self.backend.describe().get("providers", [self.backend.name]))

    def describe(self) -> dict[str, Any]:
        return {"fanout_k": self.fanout_k, "context": self.prompt_builder.n,
                **self.backend.describe()}

    def __call__(self, batch: Sequence[PathQuery]) -> list[PathAnswer]:
        clock = StageClock()
        texts = [q.text for q in batch]
        queries = self.encoder.encode(texts)  # (B, d)
        clock.lap("encode")
        prompts = self.prompt_builder.prompts(texts, queries)
        clock.lap("search")
        generations = self.backend.generate(prompts)
        if len(generations) != len(batch):
            raise RuntimeError(f"{len(generations)} completions for {len(batch)} queries")
        clock.lap("decode")
        parsed = [parse_fanout(g.text, self.fanout_k) for g in generations]
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
                                             [q.k for q in batch], caps)
        clock.lap("search")
        answers = []
        for p, group, found, generation, selection, g in zip(
                parsed, subs, probes, generations, selections, grounded.tolist(), strict=True):
            notes = []
            if not p.well_formed:
                notes.append(f"malformed fan-out: {len(group)} of {self.fanout_k} sub-queries "
                             "usable")
            if selection.filled:
                notes.append(f"{selection.filled} slots filled from the query's dense neighbours")
            answers.append(PathAnswer(selection, g, found, notes=notes,
                                      well_formed=p.well_formed, subqueries=group,
                                      tokens=generation.n_tokens))
        clock.lap("postprocess")
        return stamp(answers, clock)
