"""The diffusion retriever's runtime: the exported whole-solver ONNX graph, numpy in and out.

`diffusion/sampler.onnx` maps query embeddings (B, d) and standard-normal noise (B, L, d) to
L generated unit rows per query in one `session.run`; resolving rows to catalog items is
`service.resolution.distinct_nearest`. A model with a context (`context` = C in
diffusion.json) also takes the embeddings of C catalog items per query (B, C, d), best first:
its nearest, or those its fan-out prompt names (`context_source`), as
`service.paths.DiffusionContext` looks them up. Several draws per query (`draws`) are the
caller's: `service.paths.draw_rows`. ONNX Runtime's CUDA provider is
used when available. `StepSampler` runs the same solver as a host loop over
`diffusion/step.onnx` with IO binding (query and context bound once on the device; the graph
for GPU runners that manage their own buffers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from service.errors import BundleError
from service.sessions import open_session

CONFIG_FILE = "diffusion.json"
SAMPLER_FILE = "sampler.onnx"
STEP_FILE = "step.onnx"
CONTEXT_INPUT = "context"


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
        self.rows = int(self.config["rows"])
        self.dim = int(self.config["dim"])
        self.context = int(self.config.get("context", 0))

    def noise(self, batch: int, seed: int | None = None) -> np.ndarray:
        """Standard-normal starting noise (B, L, d); the same seed gives the same noise."""
        rng = np.random.default_rng(seed)
        return rng.standard_normal((batch, self.rows, self.dim), dtype=np.float32)

    def feeds(self, query_emb: np.ndarray, context: np.ndarray | None) -> dict[str, np.ndarray]:
        """The validated query and context inputs (the context only when the model has one)."""
        query = np.ascontiguousarray(query_emb, dtype=np.float32)
        if query.ndim != 2 or query.shape[1] != self.dim:
            raise ValueError(f"query_emb must be (B, {self.dim}), got {query.shape}")
        if not self.context:
            return {"query": query}
        expected = (len(query), self.context, self.dim)
        if context is None or context.shape != expected:
            got = None if context is None else context.shape
            raise ValueError(f"this sampler needs context {expected} (see "
                             f"service.paths.DiffusionContext), got {got}")
        return {"query": query, CONTEXT_INPUT: np.ascontiguousarray(context, dtype=np.float32)}

    def sample(self, query_emb: np.ndarray, seed: int | None = None,
               noise: np.ndarray | None = None,
               context: np.ndarray | None = None) -> np.ndarray:
        """Generated rows (B, L, d), unit-norm, for query embeddings (B, d) and, when the model
        has one, their context (B, C, d)."""
        feeds = self.feeds(query_emb, context)
        batch = len(feeds["query"])
        if noise is None:
            noise = self.noise(batch, seed)
        if batch == 0:
            return np.zeros((0, self.rows, self.dim), dtype=np.float32)
        feeds["noise"] = np.ascontiguousarray(noise, dtype=np.float32)
        return self.session.run(["rows"], feeds)[0]


def sigma_schedule(steps: int, sigma_min: float, sigma_max: float, rho: float = 7.0) -> np.ndarray:
    """EDM noise levels σ_max … σ_min then 0 (mirrors `training.samplers.sigma_schedule`)."""
    if steps == 1:
        return np.array([sigma_max, 0.0])
    ramp = np.arange(steps) / (steps - 1)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return np.append((hi + ramp * (lo - hi)) ** rho, 0.0)


class StepSampler(DiffusionSampler):
    """The exported solver as a host loop of `step.onnx` runs with IO binding."""

    def __init__(self, diffusion_dir: Path, providers: list[str] | None = None,
                 threads: int = 0) -> None:
        diffusion_dir = Path(diffusion_dir)
        self.config = read_config(diffusion_dir)
        self.session = open_session(
            diffusion_dir / self.config.get("step_file", STEP_FILE), providers, threads
        )
        self.providers = self.session.get_providers()
        self.device = "cuda" if self.providers[0] == "CUDAExecutionProvider" else "cpu"
        self.rows, self.dim = int(self.config["rows"]), int(self.config["dim"])
        self.context = int(self.config.get("context", 0))
        self.sigmas = sigma_schedule(int(self.config["steps"]), float(self.config["sigma_min"]),
                                     float(self.config["sigma_max"]))

    def _denoise(self, binding: ort.IOBinding, x: np.ndarray, sigma: float) -> np.ndarray:
        binding.bind_cpu_input("x", x)
        binding.bind_cpu_input("sigma", np.full(len(x), sigma, dtype=np.float32))
        binding.bind_output("denoised", self.device)
        self.session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    def sample(self, query_emb: np.ndarray, seed: int | None = None,
               noise: np.ndarray | None = None,
               context: np.ndarray | None = None) -> np.ndarray:
        fixed = self.feeds(query_emb, context)  # query (B, d) [, context (B, C, d)]
        query = fixed["query"]
        noise = self.noise(len(query), seed) if noise is None else noise
        binding = self.session.io_binding()
        for name, value in fixed.items():  # bound once on the device for every step
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, self.device))
        heun = self.config["solver"] == "heun"
        x = (noise * np.float32(self.sigmas[0])).astype(np.float32)  # (B, L, d)
        for sigma, sigma_next in zip(self.sigmas[:-1], self.sigmas[1:], strict=True):
            slope = (x - self._denoise(binding, x, sigma)) / np.float32(sigma)
            x_next = (x + np.float32(sigma_next - sigma) * slope).astype(np.float32)
            if heun and sigma_next > 0:
                slope_next = (x_next - self._denoise(binding, x_next, sigma_next)) / np.float32(
                    sigma_next)
                x_next = (x + np.float32(sigma_next - sigma) * 0.5 * (slope + slope_next))
            x = x_next.astype(np.float32)
        return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
