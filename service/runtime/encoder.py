"""Text encoder shared by the offline job and the service: WordLlama, Matryoshka-truncated.

WordLlama ships its 256-d weights inside the wheel; we point `cache_dir` at the package folder
and disable downloads so that nothing is ever fetched from a hub at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

FULL_DIM = 256
MATRYOSHKA_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class EncoderConfig:
    """Which encoder and at what (Matryoshka) dimension."""

    name: str = "wordllama-l2_supercat"
    dim: int = 128
    batch_size: int = 512


class Encoder:
    """Embeds texts as L2-normalised float32 vectors of `config.dim` dimensions."""

    def __init__(self, config: EncoderConfig | None = None) -> None:
        import wordllama
        from wordllama import WordLlama  # deferred: loading reads ~30 MB of weights

        self.config = config or EncoderConfig()
        if self.config.dim not in MATRYOSHKA_DIMS:
            raise ValueError(f"encoder dim must be one of {MATRYOSHKA_DIMS}, got {self.config.dim}")
        package_dir = Path(wordllama.__file__).parent
        self._model = WordLlama.load(
            config="l2_supercat",
            cache_dir=package_dir,
            dim=FULL_DIM,
            trunc_dim=self.config.dim if self.config.dim != FULL_DIM else None,
            disable_download=True,
        )

    @property
    def dim(self) -> int:
        return self.config.dim

    def encode(self, texts: list[str]) -> np.ndarray:
        """Return (N, dim) float32 unit vectors; an empty list gives a (0, dim) array."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        raw = self._model.embed(list(texts), norm=False, batch_size=self.config.batch_size)
        return normalize(np.asarray(raw, dtype=np.float32))


def normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """L2-normalise the last axis; zero vectors stay zero."""
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.maximum(norms, eps)).astype(np.float32, copy=False)
