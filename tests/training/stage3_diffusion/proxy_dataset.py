"""Proxy stage-2 datasets for tests and for sizing the denoiser — never shipped as training data.

`synthetic_blocks`: random unit vectors, seconds to build. `neighbour_blocks`: for each train
query of a bundle, blocks of k items sampled among its dense nearest neighbours (the stage-2
format without a fan-out model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.runtime.encoder import normalize

if TYPE_CHECKING:
    from training.stage3_diffusion.context import Neighbourhood


@dataclass
class ProxyDataset:
    query_emb: np.ndarray  # (N, d)
    target_emb: np.ndarray  # (N, k, d)
    target_rows: np.ndarray  # (N, k)
    query_index: np.ndarray  # (N,)
    reward: np.ndarray  # (N,)
    queries: list[str] = field(default_factory=list)
    catalog: np.ndarray | None = None  # (M, d) the items `target_rows` index, when known


def synthetic_blocks(n_queries: int = 8, per_query: int = 4, k: int = 10, d: int = 128,
                     seed: int = 0) -> ProxyDataset:
    """Each query has k·2 'catalog' items near it; blocks draw k of them."""
    rng = np.random.default_rng(seed)
    centres = normalize(rng.normal(size=(n_queries, d)))  # (Q, d)
    noise = rng.normal(size=(n_queries, 2 * k, d))
    items = normalize(centres[:, None, :] + 0.3 * noise)  # (Q, 2k, d)
    picks = np.stack([rng.choice(2 * k, size=k, replace=False)
                      for _ in range(n_queries * per_query)])  # (N, k)
    query_index = np.repeat(np.arange(n_queries), per_query)  # (N,)
    target = items[query_index[:, None], picks]  # (N, k, d)
    return ProxyDataset(
        query_emb=centres[query_index], target_emb=target,
        target_rows=query_index[:, None] * 2 * k + picks, query_index=query_index,
        reward=np.zeros(len(query_index), np.float32),
        queries=[f"q{i}" for i in range(n_queries)], catalog=items.reshape(-1, d),
    )


def synthetic_neighbourhood(data: ProxyDataset, n: int, parts: tuple[str, ...] = (),
                            mentions: bool = False) -> Neighbourhood:
    """The blocks' context: each query's n nearest items of the dataset's catalog (with
    `parts`, random unit part vectors for each item; with `mentions`, random mention columns
    and teacher scores)."""
    from service.artifacts.parts import ItemParts
    from service.ranker.mention_context import MENTION_WIDTH
    from service.runtime.index import build_index
    from training.stage3_diffusion.context import Neighbourhood, block_neighbourhood

    assert data.catalog is not None
    item_parts = None
    if parts:
        vectors = normalize(np.random.default_rng(1).normal(
            size=(len(data.catalog), len(parts), data.catalog.shape[1])))
        item_parts = ItemParts(parts, vectors.astype(np.float16))
    near = block_neighbourhood(data, build_index(data.catalog), data.catalog, n,
                               parts=item_parts)
    if not mentions:
        return near
    rng = np.random.default_rng(2)  # one context per block: its query's, drawn at random
    base = near.of(np.arange(len(data.query_emb))).numpy()  # (N, C, d [+ P])
    columns = rng.uniform(0, 1, (*base.shape[:2], MENTION_WIDTH)).astype(np.float32)
    scores = rng.normal(size=base.shape[:2]).astype(np.float32)  # (N, C)
    return Neighbourhood(near.rows, near.embeddings, np.concatenate([base, columns], -1),
                         np.arange(len(data.query_emb)), scores)


def neighbour_blocks(bundle_dir: Path, per_query: int = 128, k: int = 10, top: int = 100,
                     seed: int = 0) -> ProxyDataset:
    """Blocks of k distinct items drawn among each train query's `top` dense neighbours."""
    from service.artifacts.bundle import load_bundle
    from service.runtime.encoder import Encoder
    from service.runtime.index import search
    from training.data.splits import query_texts

    bundle = load_bundle(bundle_dir)
    texts = query_texts(bundle_dir, "train")
    query_emb = Encoder(bundle.encoder_config).encode(texts)  # (Q, d)
    _, neighbours = search(bundle.index, query_emb, top)  # (Q, top)
    rng = np.random.default_rng(seed)
    query_index = np.repeat(np.arange(len(texts)), per_query)  # (N,)
    picks = np.argsort(rng.random((len(query_index), top)), axis=1)[:, :k]  # (N, k)
    rows = neighbours[query_index[:, None], picks]  # (N, k)
    return ProxyDataset(
        query_emb=query_emb[query_index], target_emb=bundle.items.embeddings[rows],
        target_rows=rows, query_index=query_index,
        reward=np.zeros(len(query_index), np.float32), queries=texts,
        catalog=bundle.items.embeddings,
    )


def tiny_checkpoint(run_dir: Path, rows: int = 10, steps: int = 20, context: int = 0,
                    **model: Any) -> Path:
    """Train the `tiny` preset (with `model` overrides) for a few steps on synthetic blocks,
    whose context is their nearest items whatever the source; returns the checkpoint."""
    from training.stage3_diffusion.denoiser import preset
    from training.stage3_diffusion.trainer import CHECKPOINT, train, train_preset

    model = preset("tiny", rows=rows, context=context, **model)
    config = train_preset("tiny", steps=steps, model=model)
    data = synthetic_blocks()
    neighbours = synthetic_neighbourhood(data, context, model.parts, model.mentions) \
        if context else None
    train(data, config, run_dir, progress=False, context=neighbours)
    return run_dir / CHECKPOINT


def tiny_diffusion_dir(directory: Path, solver: str = "heun", steps: int = 3,
                       cfg_weight: float = 0.1, rows: int = 10, context: int = 0,
                       form: str = "unrolled", **model: Any) -> Path:
    """A tiny exported `diffusion/` folder (step.onnx, sampler.onnx, diffusion.json).

    A few training steps leave the zero-initialised output layers near zero, so the weights
    are perturbed to make every path of the graph (the query's included) matter.
    """
    import torch

    from training.stage3_diffusion.export import ExportConfig, write_sampler
    from training.stage3_diffusion.trainer import load_ema

    denoiser, _ = load_ema(tiny_checkpoint(directory / "run", rows=rows, context=context,
                                           **model))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in denoiser.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    out = directory / "diffusion"
    write_sampler(denoiser, ExportConfig(solver=solver, steps=steps, cfg_weight=cfg_weight,
                                         form=form), out)
    return out
