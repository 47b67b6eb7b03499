"""Warnings third-party libraries print on every healthy build (deprecations inside torch's ONNX
exporter and transformers, axis names the exporter merges by itself) and their chatty loggers
(WordLlama's import turns on INFO for every logger; bm25s logs at DEBUG): silenced, so the r4t
command's log shows only what needs a reader."""

from __future__ import annotations

import logging
import warnings

# (category, the start of the message) of each warning no change of ours could remove
NOISE: tuple[tuple[type[Warning], str], ...] = (
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),  # torch.export pytree
    (UserWarning, r"# The axis name: \w+ will not be used"),  # exporter merges equal axes
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),  # transformers, via trl
)


CHATTY_LOGGERS = ("bm25s", "onnx_ir", "onnxscript")  # below WARNING, nothing for a reader


def silence_library_noise() -> None:
    """Ignore the warnings in NOISE in this process (the r4t command's training subcommands),
    and log only warnings: the root logger set up first, so no library's import sets it."""
    for category, message in NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
    logging.basicConfig(level=logging.WARNING)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
