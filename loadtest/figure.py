"""The benchmarks' plots: one axes on matplotlib's headless backend, saved and closed on exit."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def figure(path: Path, size: tuple[float, float]) -> Iterator[Any]:
    """Yield the axes of a new figure; on exit, lay it out and write it to `path` as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
