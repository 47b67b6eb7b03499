"""The ranker's trees compiled to machine code by lleaves (LLVM), so scoring a batch's
candidates costs a fraction of LightGBM's tree walk with the same scores; LightGBM itself where
lleaves is not installed. Compiled once per model file in a process (a reload or a second
scorer of one bundle reuses it)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from service.artifacts.bundle import sha256_file

KEPT = 4  # compiled models kept per process: a serving and a reloading bundle, and tests'


class Booster(Protocol):
    def predict(self, features: np.ndarray) -> np.ndarray: ...


class LightGBMBooster:
    """LightGBM's own prediction, one at a time per model (its booster is not thread-safe)."""

    def __init__(self, booster: Any) -> None:
        self.booster, self._lock = booster, threading.Lock()

    @classmethod
    def load(cls, model: Path) -> LightGBMBooster:
        try:
            import lightgbm
        except OSError as exc:  # its wheel's shared library needs one the system lacks
            raise ImportError(f"lightgbm cannot load its library ({exc}): install the "
                              "system's OpenMP runtime (Debian: libgomp1)") from exc
        return cls(lightgbm.Booster(model_file=str(model)))

    def predict(self, features: np.ndarray) -> np.ndarray:
        with self._lock:
            return np.asarray(self.booster.predict(features, num_threads=1), dtype=np.float64)


class CompiledBooster:
    """lleaves' compiled model: a plain function of the feature rows, safe across threads."""

    def __init__(self, model: Path) -> None:
        import lleaves

        self.model: Any = lleaves.Model(model_file=str(model))
        self.model.compile()

    def predict(self, features: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(features, dtype=np.float64)  # (C, F)
        return np.asarray(self.model.predict(rows, n_jobs=1), dtype=np.float64)


_compiled: OrderedDict[str, Booster] = OrderedDict()
_compiling = threading.Lock()


def load_booster(model: Path) -> Booster:
    """The model file's compiled booster (kept by its sha256), or LightGBM's without lleaves."""
    try:
        import lleaves  # noqa: F401
    except ImportError:
        return LightGBMBooster.load(model)
    key = sha256_file(model)
    with _compiling:
        booster = _compiled.pop(key, None) or CompiledBooster(model)
        _compiled[key] = booster
        while len(_compiled) > KEPT:
            _compiled.popitem(last=False)
    return booster
