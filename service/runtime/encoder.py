"""Text encoder shared by the offline job and the service: a bundle setting (manifest `encoder`).

WordLlama (the default, Matryoshka-truncated) loads its weights from its own wheel, downloads
off; a sentence transformer exported to ONNX in the bundle's `encoder/` runs in ONNX Runtime with
`tokenizers`, so the service needs no torch. Items and queries are embedded by this one
object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from service.errors import BundleError
from service.runtime.sessions import open_session

FULL_DIM = 256
MATRYOSHKA_DIMS = (64, 128, 256)
WORDLLAMA = "wordllama-l2_supercat"
ENCODER_FOLDER = "encoder"  # in a bundle: an exported ONNX encoder
ENCODER_META = "encoder.json"
TOKENS_PER_RUN = 16_384  # padded tokens per ONNX run: bounds the attention's memory


@dataclass(frozen=True)
class EncoderConfig:
    """Which encoder and at what dimension; `folder` holds an exported ONNX encoder."""

    name: str = WORDLLAMA
    dim: int = 128
    batch_size: int = 512
    folder: str | None = None  # None: WordLlama


class Backend(Protocol):
    """What turns texts into raw (N, dim) vectors; Encoder normalises them."""

    def embed(self, texts: list[str]) -> np.ndarray: ...


class WordLlamaBackend:
    """WordLlama from its wheel, truncated to a Matryoshka dimension."""

    def __init__(self, config: EncoderConfig) -> None:
        import wordllama
        from wordllama import WordLlama  # deferred: loading reads ~30 MB of weights

        if config.dim not in MATRYOSHKA_DIMS:
            raise ValueError(f"encoder dim must be one of {MATRYOSHKA_DIMS}, got {config.dim}")
        self.batch_size = config.batch_size
        self._model = WordLlama.load(
            config="l2_supercat",
            cache_dir=Path(wordllama.__file__).parent,
            dim=FULL_DIM,
            trunc_dim=config.dim if config.dim != FULL_DIM else None,
            disable_download=True,
        )

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self._model.embed(texts, norm=False, batch_size=self.batch_size))


class OnnxBackend:
    """An exported transformer encoder: tokenize, run the graph (pooling inside), (N, dim)."""

    def __init__(self, config: EncoderConfig, threads: int = 0,
                 providers: list[str] | None = None) -> None:
        from tokenizers import Tokenizer

        folder = Path(str(config.folder))
        meta = read_meta(folder)
        if int(meta["dim"]) != config.dim:
            raise BundleError(f"{folder}: the encoder gives {meta['dim']}-d vectors, the "
                              f"manifest says {config.dim}")
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(int(meta["max_length"]))
        self.tokenizer.no_padding()  # padded per batch below, to that batch's longest text
        self.pad_id = int(meta.get("pad_id", 0))
        self.batch_size, self.dim = config.batch_size, config.dim
        self.session = open_session(folder / str(meta["model"]), providers, threads)
        self.inputs = [i.name for i in self.session.get_inputs()]

    def embed(self, texts: list[str]) -> np.ndarray:
        encodings = self.tokenizer.encode_batch(texts)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for rows in self._runs([len(e.ids) for e in encodings]):
            out[rows] = self._run([encodings[i] for i in rows])
        return out

    def _runs(self, lengths: list[int]) -> list[list[int]]:
        """Text indices by length, cut into runs of at most batch_size texts and
        TOKENS_PER_RUN padded tokens: texts of like length share a run and pad little."""
        runs: list[list[int]] = [[]]
        for i in np.argsort(lengths, kind="stable").tolist():  # shortest first
            if runs[-1] and (len(runs[-1]) == self.batch_size
                             or (len(runs[-1]) + 1) * lengths[i] > TOKENS_PER_RUN):
                runs.append([])
            runs[-1].append(i)
        return [run for run in runs if run]

    def _run(self, encodings: list[Any]) -> np.ndarray:
        width = max(len(e.ids) for e in encodings)
        ids = np.full((len(encodings), width), self.pad_id, dtype=np.int64)  # (B, T)
        mask = np.zeros((len(encodings), width), dtype=np.int64)  # (B, T)
        for row, e in enumerate(encodings):
            ids[row, : len(e.ids)], mask[row, : len(e.ids)] = e.ids, 1
        feeds = {"input_ids": ids, "attention_mask": mask,
                 "token_type_ids": np.zeros_like(ids)}
        return self.session.run(None, {k: feeds[k] for k in self.inputs})[0]  # (B, dim)


def read_meta(folder: Path) -> dict[str, Any]:
    """An exported encoder's encoder.json (model file, dim, max_length, pad_id)."""
    path = folder / ENCODER_META
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BundleError(f"{folder} holds no readable exported encoder: {exc}") from exc
    missing = [key for key in ("model", "dim", "max_length") if key not in meta]
    if missing:
        raise BundleError(f"{path} lacks {missing}")
    return meta


class Encoder:
    """Embeds texts as L2-normalised float32 vectors of `config.dim` dimensions."""

    def __init__(self, config: EncoderConfig | None = None, threads: int = 0,
                 providers: list[str] | None = None) -> None:
        self.config = config or EncoderConfig()
        self._backend: Backend = (WordLlamaBackend(self.config) if self.config.folder is None
                                  else OnnxBackend(self.config, threads, providers))

    @property
    def dim(self) -> int:
        return self.config.dim

    def encode(self, texts: list[str]) -> np.ndarray:
        """Return (N, dim) float32 unit vectors; an empty list gives a (0, dim) array."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return normalize(np.asarray(self._backend.embed(list(texts)), dtype=np.float32))


def normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """L2-normalise the last axis; zero vectors stay zero."""
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.maximum(norms, eps)).astype(np.float32, copy=False)
