"""ONNX Runtime sessions for both model runtimes: one place chooses providers and threads.

CUDA is used when this onnxruntime build offers it, else the CPU provider; other providers a
build may list (e.g. Azure) are never picked by default. Intra-op threads do not spin-wait
between runs: on a small machine the spinning steals the cores FAISS needs right after.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnxruntime as ort

from service.errors import BundleError

log = logging.getLogger("r4t.sessions")

PREFERRED_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")


def default_providers() -> list[str]:
    available = ort.get_available_providers()
    return [p for p in PREFERRED_PROVIDERS if p in available]


def chosen_providers(requested: list[str] | None) -> list[str]:
    """The requested providers this build has, in order (a missing one is logged); the
    default when none is requested; a BundleError when none of those requested is here."""
    if not requested:
        return default_providers()
    available = ort.get_available_providers()
    chosen = [p for p in requested if p in available]
    missing = [p for p in requested if p not in available]
    if not chosen:
        raise BundleError(f"none of the requested ONNX Runtime providers {missing} is in this "
                          f"build (it has {available}): set R4T_PROVIDERS to one of those, or "
                          "auto")
    if missing:
        log.warning("ONNX Runtime providers %s are not in this build; using %s", missing, chosen)
    return chosen


def session_options(threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads > 0:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return options


def open_session(path: Path, providers: list[str] | None, threads: int) -> ort.InferenceSession:
    return ort.InferenceSession(
        str(path), session_options(threads), providers=chosen_providers(providers)
    )
