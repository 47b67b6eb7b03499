"""The one interface the AR path asks of a fan-out backend (service/backends/: ONNX, llama.cpp,
an OpenAI-compatible endpoint), so the path never knows which one writes its fan-outs."""

from __future__ import annotations

from typing import Any, Protocol

from service.fanout.format import Generation


class FanoutBackend(Protocol):
    """Writes one fan-out completion per prompt (text in service.fanout.format's format)."""

    name: str

    def generate(self, prompts: list[str], deadline: float | None = None
                 ) -> list[Generation]:
        """`deadline` (time.monotonic()): past it, DeadlineError instead of a late answer."""
        ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
