"""The ranker's trees compiled to machine code by lleaves (LLVM), so scoring a batch's
candidates costs a fraction of LightGBM's tree walk with the same scores; LightGBM itself where
lleaves is not installed. Compiled once per model file in a process (a reload or a second
scorer of one bundle reuses it), and kept as an object file in the temporary folder, named by
the model's sha256, lleaves' version and this CPU, so a restart loads it in milliseconds
instead of compiling for seconds."""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from importlib.metadata import version
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from service.artifacts.bundle import sha256_file

KEPT = 4  # compiled models kept per process: a serving and a reloading bundle, and tests'
CACHE_DIR = "r4t-ranker"  # under the temporary folder: compiled models, by content and CPU


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

    def __init__(self, model: Path, cache: Path | None = None) -> None:
        import lleaves

        self.model: Any = lleaves.Model(model_file=str(model))
        if cache is None:
            self.model.compile()
        elif cache.is_file():
            self.model.compile(cache=str(cache))  # loaded, not compiled
        else:  # written whole under another name, then renamed: a reader sees all or nothing
            partial = cache.with_name(f"{cache.name}.{os.getpid()}.{threading.get_ident()}")
            try:
                self.model.compile(cache=str(partial))
                os.replace(partial, cache)
            except OSError:  # a full or read-only folder: kept in memory only
                partial.unlink(missing_ok=True)
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
        booster = _compiled.pop(key, None) or CompiledBooster(model, object_file(key))
        _compiled[key] = booster
        while len(_compiled) > KEPT:
            _compiled.popitem(last=False)
    return booster


def object_file(model_sha: str) -> Path | None:
    """Where this model's machine code for this CPU is kept (None: no folder of this user's to
    keep it in). lleaves loads an existing file unchecked, so its name holds everything the
    code depends on."""
    import llvmlite.binding as llvm

    host = f"{llvm.get_host_cpu_name()} {llvm.get_host_cpu_features().flatten()}"
    made_by = f"{model_sha} lleaves {version('lleaves')} llvmlite {version('llvmlite')} {host}"
    folder = Path(tempfile.gettempdir()) / CACHE_DIR
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        if folder.stat().st_uid != os.getuid():  # another user's: never loaded from
            return None
    except OSError:
        return None
    return folder / f"{hashlib.sha256(made_by.encode()).hexdigest()[:32]}.o"
