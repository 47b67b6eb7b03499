"""The one interface the AR path asks of a fan-out backend (service/backends/: ONNX, llama.cpp,
an OpenAI-compatible endpoint), so the path never knows which one writes its fan-outs."""

from __future__ import annotations

from typing import Any, Protocol

from service.fanout.format import Generation


class FanoutBackend(Protocol):
    """Writes fan-out completions (text in service.fanout.format's format): the AR path's one
    per prompt, stage 2's n samples of one prompt."""

    name: str

    def generate(self, prompts: list[str], deadline: float | None = None, n: int = 1,
                 seed: int | None = None) -> list[Generation]:
        """n completions per prompt, prompt-major (len(prompts)·n). `deadline`
        (time.monotonic()): past it, DeadlineError instead of a late answer. `seed`: this
        call's, in place of the backend's own."""
        ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
