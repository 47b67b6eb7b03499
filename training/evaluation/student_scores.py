"""What the solver adds: a standalone student's own item scores over its served context (the
part of its rows' logits every row shares), then the ranker's greedy spread, no solver. The
same context and scorer as the `diffusion` route; only the set-writing differs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from service.artifacts.bundle import Bundle
from service.errors import BundleError
from service.ranker.ranker import Ranker, RankerConfig
from service.routes.diffusion import DiffusionContext
from service.runtime.sampler import read_config
from training.evaluation.baselines import Method, MethodOutput, fanout_output


def diffusion_scores(bundle: Bundle, k: int = 10, checkpoint: Path | None = None,
                     redundancy: float = 1.0, threads: int = 0) -> Method:
    """Eval factory: the bundle's stage-3 checkpoint (default: runs/diffusion) scoring the
    context its exported sampler reads; `redundancy`: the spread's λ on those scores;
    `threads`: torch's (0: its own choice)."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)

    from training.stage3_diffusion.trainer import load_ema

    path = checkpoint or bundle.path / "runs" / "diffusion" / "checkpoint.pt"
    if not path.is_file():
        raise BundleError(f"no stage-3 checkpoint at {path}: `r4t train diffusion` writes one")
    model, _ = load_ema(path)
    if not model.config.mentions:
        raise BundleError("diffusion-scores reads a student's item scores: its denoiser has "
                          "none (train one with --preset standalone)")
    context = DiffusionContext(bundle, read_config(bundle.path / "diffusion"))
    spread = Ranker(RankerConfig(model=None, redundancy=redundancy))

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        rows = context.rows(texts, queries)  # (Q, C)
        features = context.features(context.embeddings(rows), rows, queries, texts)
        with torch.no_grad():
            scores = model.item_scores(torch.from_numpy(features)).numpy()  # (Q, C)
        picks = spread.choose_each(list(scores), list(rows), [k] * len(rows),
                                   bundle.items.embeddings)
        chosen = np.array([row[p] for row, p in zip(rows, picks, strict=True)])  # (Q, k)
        out = fanout_output(bundle, bundle.items.embeddings[chosen], chosen)
        out.candidates = list(rows)
        return out

    return run
