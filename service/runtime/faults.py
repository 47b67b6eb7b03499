"""Fault injection for chaos tests: a sampler whose runs fail for a set fraction of batches, so
that the fallback to the AR path, its counter and its alert can be shown firing on purpose; and
batches that stall, so that admission can be shown refusing while a batch overruns."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import numpy as np

from service.runtime.sampler import Draw


class InjectedFaultError(RuntimeError):
    """Raised on purpose by a faulty runtime (R4T_FAULT_* settings)."""


class Stall:
    """Once armed (after warm-up), each call (one batch of any route) sleeps `seconds` with
    probability `rate`: a batch stuck in an engine, as the batcher sees it."""

    def __init__(self, rate: float, seconds: float, seed: int | None = None) -> None:
        self.rate, self.seconds = rate, seconds
        self._random = random.Random(seed)
        self._lock = threading.Lock()  # every route's worker thread calls it
        self.armed = False

    def __call__(self) -> None:
        if not self.armed or self.rate <= 0:  # production: no lock taken per batch
            return
        with self._lock:
            stall = self._random.random() < self.rate
        if stall:
            time.sleep(self.seconds)


class FaultySampler:
    """Wraps a sampler; once armed (after warm-up), each `draw` (one batch) raises
    with probability `rate`."""

    def __init__(self, sampler: Any, rate: float, seed: int | None = None) -> None:
        self._sampler, self.rate = sampler, rate
        self._random = random.Random(seed)
        self._lock = threading.Lock()  # warm-up and the batcher may call from two threads
        self.armed = False
        self.providers: list[str] = sampler.providers
        self.config: dict = sampler.config

    def arm(self) -> None:
        """Start failing: after warm-up, once the path serves."""
        self.armed = True

    def sample(self, query_emb: np.ndarray, seed: int | None = None,
               noise: np.ndarray | None = None, context: np.ndarray | None = None,
               embeddings: np.ndarray | None = None) -> np.ndarray:
        return self.draw(query_emb, seed, noise, context, embeddings).rows

    def draw(self, query_emb: np.ndarray, seed: int | None = None,
             noise: np.ndarray | None = None, context: np.ndarray | None = None,
             embeddings: np.ndarray | None = None) -> Draw:
        with self._lock:
            fail = self.armed and self._random.random() < self.rate
        if fail:
            raise InjectedFaultError(f"injected fault (R4T_FAULT_DIFFUSION_RATE={self.rate})")
        return self._sampler.draw(query_emb, seed=seed, noise=noise, context=context,
                                  embeddings=embeddings)

    def __getattr__(self, name: str) -> Any:  # anything else the path reads (e.g. describe)
        return getattr(self._sampler, name)
