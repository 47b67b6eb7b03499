"""The diffusion route's runtime: `diffusion/sampler.onnx`, the whole solver in one graph, maps
queries (B, d), noise (B, L, d) and a context's item vectors to L unit rows per query (or a
mixture head's weights over the context, whose mixtures the rows are) in one `session.run`;
CUDA where available."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import BundleError
from service.runtime.sessions import open_session

CONFIG_FILE = "diffusion.json"
SAMPLER_FILE = "sampler.onnx"
STEP_FILE = "step.onnx"
CONTEXT_INPUT = "context"
ROWS_OUTPUT = "rows"
WEIGHTS_OUTPUT = "weights"  # a mixture head's (B, L, C): which context item each row is
# a projected student's item table (M, h): each catalog item's embedding through the first
# layer that reads it, computed at export, so the service gathers h numbers an item, not d
ITEMS_FILE = "items.npy"
NOISE_VALUES = 1 << 20  # the starting noise's table of standard normals (4 MB)


@dataclass(frozen=True)
class Draw:
    """One run of the sampler: unit rows (B, L, d) and, for a mixture head, their weights
    (B, L, C) over the context items (the rows are those mixtures), else None."""

    rows: np.ndarray
    weights: np.ndarray | None = None


def read_config(diffusion_dir: Path) -> dict[str, Any]:
    path = Path(diffusion_dir) / CONFIG_FILE
    if not path.is_file():
        raise BundleError(f"no diffusion model at {diffusion_dir}: {CONFIG_FILE} is missing "
                          "(run `r4t export diffusion`)")
    return json.loads(path.read_text(encoding="utf-8"))


class DiffusionSampler:
    """Runs the exported sampler: `sample(query_emb (B, d), seed) -> rows (B, L, d)`."""

    def __init__(self, diffusion_dir: Path, providers: list[str] | None = None,
                 threads: int = 0) -> None:
        diffusion_dir = Path(diffusion_dir)
        self.config: dict[str, Any] = read_config(diffusion_dir)
        path = diffusion_dir / self.config.get("sampler_file", SAMPLER_FILE)
        if not path.is_file():
            raise BundleError(f"{path} is missing")
        self.session = open_session(path, providers, threads)
        self.providers: list[str] = self.session.get_providers()
        # whether the graph returns its rows' weights over the context (a mixture head), and
        # whether it returns the rows too (else they are the weights' mixture, mixed here)
        outputs = [o.name for o in self.session.get_outputs()]
        self.pointed, self.mixed = WEIGHTS_OUTPUT in outputs, ROWS_OUTPUT not in outputs
        self.rows = int(self.config["rows"])
        self.dim = int(self.config["dim"])
        self.context = int(self.config.get("context", 0))
        # one context item's width: its embedding, then what else the model reads of it
        self.width = int(self.config.get("context_width",
                                         self.dim + len(self.config.get("parts", ()))))
        self.table = noise_table(self.rows * self.dim)  # (W, L·d)
        items = self.config.get("items_file")
        self.items: np.ndarray | None = None if items is None else load_items(
            diffusion_dir / items)  # (M, h): the context's first h columns are its rows

    def noise(self, batch: int, seed: int | None = None) -> np.ndarray:
        """Standard-normal starting noise (B, L, d); the same seed gives the same noise."""
        at = np.random.default_rng(seed).integers(0, len(self.table), batch)  # (B,)
        return self.table[at].reshape(batch, self.rows, self.dim)

    def feeds(self, query_emb: np.ndarray, context: np.ndarray | None) -> dict[str, np.ndarray]:
        """The validated query and context inputs (the context only when the model has one)."""
        query = np.ascontiguousarray(query_emb, dtype=np.float32)
        if query.ndim != 2 or query.shape[1] != self.dim:
            raise ValueError(f"query_emb must be (B, {self.dim}), got {query.shape}")
        if not self.context:
            return {"query": query}
        expected = (len(query), self.context, self.width)
        if context is None or context.shape != expected:
            got = None if context is None else context.shape
            raise ValueError(f"this sampler needs context {expected} (see "
                             f"service.routes.diffusion.DiffusionContext), got {got}")
        return {"query": query, CONTEXT_INPUT: np.ascontiguousarray(context, dtype=np.float32)}

    def sample(self, query_emb: np.ndarray, seed: int | None = None,
               noise: np.ndarray | None = None, context: np.ndarray | None = None,
               embeddings: np.ndarray | None = None) -> np.ndarray:
        """Generated rows (B, L, d), unit-norm, for query embeddings (B, d) and, when the model
        has one, their context (B, C, width) (`draw`)."""
        return self.draw(query_emb, seed, noise, context, embeddings).rows

    def draw(self, query_emb: np.ndarray, seed: int | None = None,
             noise: np.ndarray | None = None, context: np.ndarray | None = None,
             embeddings: np.ndarray | None = None) -> Draw:
        """`sample`'s rows, with their weights over the context when the graph has them. A
        mixture head's rows mix the context items' `embeddings` (B, C, d): by default the
        context's first d columns, which a projected student's context does not hold."""
        feeds = self.feeds(query_emb, context)
        batch = len(feeds["query"])
        if noise is None:
            noise = self.noise(batch, seed)
        if batch == 0:
            return Draw(np.zeros((0, self.rows, self.dim), dtype=np.float32),
                        np.zeros((0, self.rows, self.context), dtype=np.float32)
                        if self.pointed else None)
        feeds["noise"] = np.ascontiguousarray(noise, dtype=np.float32)
        if self.mixed:
            [weights] = self.session.run([WEIGHTS_OUTPUT], feeds)  # (B, L, C)
            if embeddings is None and self.items is not None:
                raise ValueError("a projected student's rows mix its context's embeddings: "
                                 "pass them")
            mixed = feeds[CONTEXT_INPUT][..., : self.dim] if embeddings is None else embeddings
            return Draw(mixture_rows(weights, mixed), weights)
        found = self.session.run([ROWS_OUTPUT, *([WEIGHTS_OUTPUT] if self.pointed else [])],
                                 feeds)
        return Draw(found[0], found[1] if self.pointed else None)


def load_items(path: Path) -> np.ndarray:
    """(M, h) float32 item table of a projected student (ITEMS_FILE)."""
    if not path.is_file():
        raise BundleError(f"{path} is missing: re-export the diffusion model (`r4t export "
                          "diffusion`)")
    items = np.load(path)
    if items.ndim != 2 or items.dtype != np.float32:
        raise BundleError(f"{path} holds {items.dtype} {items.shape}, not (M, h) float32")
    return items


def noise_table(block: int, size: int = NOISE_VALUES, seed: int = 0) -> np.ndarray:
    """(W, block) windows over one table of standard normals drawn once, at load: a query's
    starting noise is the window at a random offset, i.i.d. standard normal within it (two
    queries' windows may overlap, which neither answer can tell): a gather, not a draw of a
    batch's noise anew."""
    values = np.random.default_rng(seed).standard_normal(max(size, 2 * block), dtype=np.float32)
    return np.lib.stride_tricks.sliding_window_view(values, block)


def mixture_rows(weights: np.ndarray, context: np.ndarray) -> np.ndarray:
    """(B, L, d) unit rows: each row's weights (B, L, C) over the context items' embeddings
    (B, C, d); one batched product here costs a fraction of the graph's."""
    mixed = np.matmul(weights, context)  # (B, L, d)
    return mixed / np.maximum(np.linalg.norm(mixed, axis=-1, keepdims=True), 1e-12)
