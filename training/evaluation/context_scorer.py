"""The skeptic's baseline beside the standalone diffusion student: the same context (the query's
C nearest items and their parts' cosines, service.artifacts.parts), scored per item by a
LightGBM classifier learned from the same stage-2 blocks (an item in its query's block or not),
then the ranker's greedy spread. No solver: what the denoiser adds over it is the difference."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from service.artifacts.bundle import Bundle
from service.artifacts.parts import context_features
from service.errors import BundleError
from service.ranker.ranker import Ranker, RankerConfig
from service.runtime.index import neighbour_rows
from training.evaluation.baselines import Method, MethodOutput, fanout_output

CONTEXT = 128
ROUNDS = 200


def scorer_features(bundle: Bundle, rows: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """(Q·C, 2 + P): each context item's rank, cosine to the query and parts' cosines."""
    features = context_features(bundle.items.embeddings[rows], bundle.parts, rows, queries)
    cosine = np.einsum("qcd,qd->qc", features[..., : queries.shape[1]], queries)  # (Q, C)
    rank = np.broadcast_to(np.arange(rows.shape[1], dtype=np.float32), rows.shape)
    table = np.concatenate([rank[..., None], cosine[..., None],
                            features[..., queries.shape[1]:]], axis=-1)
    return table.reshape(-1, table.shape[-1])


def train_scorer(bundle: Bundle, dataset: Path, context: int, threads: int = 1) -> object:
    """A LightGBM classifier: is a context item in its query's stage-2 block."""
    import lightgbm

    from training.stage2_synthesis.dataset import load_dataset

    if bundle.parts is None:
        raise BundleError(f"{bundle.path} has no item parts: `r4t --bundle {bundle.path} "
                          "catalog` builds them")
    if not (Path(dataset) / "queries.json").is_file():
        raise BundleError(f"{dataset} holds no stage-2 run: `r4t --bundle {bundle.path} "
                          "synthesize --teacher ranker --among nearest --context 128` writes one")
    data = load_dataset(dataset)
    _, first = np.unique(data.query_index, return_index=True)
    queries = data.query_emb[first]  # (U, d) one block per query: at T = 0 they are copies
    rows = neighbour_rows(bundle.index, queries, context)  # (U, C)
    labels = (rows[:, :, None] == data.target_rows[first][:, None, :]).any(-1)  # (U, C)
    params = {"objective": "binary", "learning_rate": 0.05, "num_leaves": 31, "verbose": -1,
              "num_threads": max(threads, 1), "seed": 0}
    table = lightgbm.Dataset(scorer_features(bundle, rows, queries), labels.reshape(-1))
    return lightgbm.train(params, table, num_boost_round=ROUNDS)


def context_scorer(bundle: Bundle, k: int = 10, dataset: Path | None = None,
                   context: int = CONTEXT, threads: int = 1) -> Method:
    """Eval factory: the scorer trained on `dataset` (default: the bundle's stage 2), then
    the ranker's greedy spread over its scores."""
    from training.stage2_synthesis.synthesis import SYNTHESIS_RUN

    model = train_scorer(bundle, dataset or bundle.path / "runs" / SYNTHESIS_RUN, context,
                         threads)
    spread = Ranker(RankerConfig(model=None))

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        rows = neighbour_rows(bundle.index, queries, context)  # (Q, C)
        scores = model.predict(scorer_features(bundle, rows, queries))  # type: ignore[attr-defined]
        scores = np.asarray(scores).reshape(rows.shape)
        picks = np.array([row[spread.choose(s, bundle.items.embeddings[row], k)]
                          for row, s in zip(rows, scores, strict=True)])  # (Q, k)
        out = fanout_output(bundle, bundle.items.embeddings[picks], picks)
        out.candidates = list(rows)
        return out

    return run
