"""The denoiser's context: per training block, the C catalog items its query's prompt or
neighbourhood gives, looked up as the service will look them up when it serves the model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from service.artifacts.parts import ItemParts, context_features
from service.errors import BundleError
from service.fanout.candidates import UNRECORDED_SOURCE, Candidates
from service.fanout.grounding import PromptNeighbourhood
from service.ranker.mention_context import MentionedNeighbourhood, encode_mentions
from service.ranker.ranker import RankedNeighbourhood, ScoredCandidates
from service.routes.diffusion import ContextLookup
from service.runtime.index import neighbour_rows

if TYPE_CHECKING:
    from training.stage3_diffusion.denoiser import DenoiserConfig


class BlockDataset(Protocol):
    """What training needs of `training.stage2_synthesis.dataset.SynthesisDataset` (stage 2)."""

    queries: list[str]
    query_emb: np.ndarray  # (N, d) float32
    target_emb: np.ndarray  # (N, k, d) float32
    target_rows: np.ndarray  # (N, k) int64 catalog rows
    query_index: np.ndarray  # (N,) int64 into `queries`


@dataclass(frozen=True)
class Neighbourhood:
    """The denoiser's context for every block: its query's C catalog rows, best first, read as
    the service reads them (`context_features`: embeddings, and with `parts` their cosines)."""

    rows: np.ndarray  # (N, C) int64 into `embeddings`
    embeddings: np.ndarray  # (M, d) float32, the catalog
    # with item parts: each distinct query's context features (U, C, d + P), computed once,
    # and each block's query among them (N,)
    features: np.ndarray | None = None
    query_of: np.ndarray | None = None
    # with mention features: the ranker's score of each distinct query's context items (U, C)
    scores: np.ndarray | None = None

    def of(self, picks: np.ndarray, device: str = "cpu") -> torch.Tensor:
        """(B, C, d [+ P]) context of the blocks `picks`."""
        if self.features is not None and self.query_of is not None:
            return torch.from_numpy(self.features[self.query_of[picks]]).to(device)
        return torch.from_numpy(np.ascontiguousarray(self.embeddings[self.rows[picks]],
                                                     dtype=np.float32)).to(device)

    def teacher(self, picks: np.ndarray, device: str = "cpu") -> torch.Tensor | None:
        """(B, C) the teacher's scores of the blocks' context items, when recorded."""
        if self.scores is None or self.query_of is None:
            return None
        return torch.from_numpy(self.scores[self.query_of[picks]]).to(device)


def block_neighbourhood(data: BlockDataset, index: Any, embeddings: np.ndarray, n: int,
                        prompt: ContextLookup | None = None,
                        parts: ItemParts | None = None,
                        mentions: ScoredCandidates | None = None) -> Neighbourhood:
    """Look each distinct query up once (its n nearest items, or with `prompt` the n items its
    prompt names); blocks of one query share its context. With `mentions` (the bundle's
    ranker and its features) each item also carries its mention columns, and the ranker's
    score of it is kept as the soft target."""
    _, first, inverse = np.unique(data.query_emb, axis=0, return_index=True,
                                  return_inverse=True)
    if prompt is None:
        rows = neighbour_rows(index, data.query_emb[first], n)  # (U, C)
    else:
        texts = [data.queries[int(data.query_index[i])] for i in first]
        rows = prompt.rows(texts, data.query_emb[first])  # (U, C)
    inverse = inverse.reshape(-1)
    if parts is None and mentions is None:
        return Neighbourhood(rows[inverse], embeddings)  # rows (N, C)
    queries, scores, columns = data.query_emb[first], None, None
    if mentions is not None:
        texts = [data.queries[int(data.query_index[i])] for i in first]
        table = mentions.features.table(texts, queries, [(r, 0) for r in rows])  # (U·C, F)
        scores = mentions.ranker.score(table).reshape(rows.shape).astype(np.float32)  # (U, C)
        columns = encode_mentions(table, n).reshape(*rows.shape, -1)  # (U, C, M)
    features = context_features(embeddings[rows], parts, rows, queries, columns)  # (U, C, W)
    return Neighbourhood(rows[inverse], embeddings, features, inverse, scores)


def check_context_size(dataset_dir: Path, n: int, source: str) -> dict[str, Any]:
    """Refuse a context of n items when the stage-2 run's teacher chose among another number
    (its config.json `context`): the student would not see what its teacher saw. Returns the
    record ({} when there is none)."""
    path = Path(dataset_dir) / "config.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    named = record.get("context")
    if named is not None and int(named) != n:
        raise BundleError(f"stage 2's teacher named {named} items ({path}) but the "
                          f"denoiser's context is {n}: they must match for "
                          f"context_source={source!r}")
    return record


def check_prompt_context(dataset_dir: Path, n: int, source: str) -> None:
    """`check_context_size`, and refuse a prompt-sourced context of `source` candidates when
    the stage-2 run's prompts named another source (its config.json `candidates`)."""
    record = check_context_size(dataset_dir, n, "prompt")
    path = Path(dataset_dir) / "config.json"
    teacher = record.get("candidates", UNRECORDED_SOURCE) if record else source
    if teacher != source:
        raise BundleError(f"the teacher's prompt names came from {teacher!r} candidates ({path}) "
                          f"but the denoiser's from {source!r}: they must match for "
                          "context_source='prompt'")


def bundle_context(bundle_dir: Path, data: BlockDataset, model: DenoiserConfig,
                   dataset_dir: Path) -> Neighbourhood | None:
    """Each block's context from the bundle, as `model.context_source` says the service will
    look it up (None for a model without a context)."""
    from service.artifacts.bundle import load_bundle

    n = model.context
    if not n:
        return None
    bundle = load_bundle(bundle_dir)
    prompt: ContextLookup | None = None
    scored = ScoredCandidates(bundle) if model.mentions or model.context_source == "ranked" \
        else None
    if model.context_source == "ranked" and scored is not None:
        check_context_size(dataset_dir, n, "ranked")
        prompt = RankedNeighbourhood(scored, n)
    elif model.reads_items:  # the query's n nearest (or mentions), each scored by the ranker
        among = check_context_size(dataset_dir, n, model.context_source).get("among", model.among)
        if among != model.among:
            raise BundleError(f"stage 2's teacher chose among its {among!r} context "
                              f"({dataset_dir}), the denoiser reads a {model.among!r} one")
        if model.context_source == "mentioned" and scored is not None:
            prompt = MentionedNeighbourhood(scored.features, bundle.index, n)
        if model.parts and (bundle.parts is None or bundle.parts.names != model.parts):
            raise BundleError(f"the denoiser reads item parts {list(model.parts)}; "
                              f"{bundle_dir} holds {bundle.manifest.get('parts')}: `r4t "
                              "catalog` rebuilds them")
    elif model.context_source == "prompt":
        check_prompt_context(dataset_dir, n, model.candidates)
        prompt = PromptNeighbourhood(Candidates.of(bundle, model.candidates),
                                     bundle.items.texts, bundle.items.embeddings, n)
    return block_neighbourhood(data, bundle.index, bundle.items.embeddings, n, prompt,
                               bundle.parts if model.parts else None,
                               scored if model.mentions else None)
