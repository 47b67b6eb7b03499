"""The one shape of a served route: a batch of RouteQuery in, a RouteAnswer per query out; and
the hooks the served state calls on any route without asking which one it is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from service.fanout.cache import FanoutCache
from service.routes.answer import RouteAnswer, RouteQuery


class Route(Protocol):
    """What service.scheduling serves. The routes subclass it for the hooks' defaults."""

    name: str
    providers: list[str]  # the engines it runs on (ONNX Runtime providers, the index backend)
    cache: FanoutCache | None = None  # the expansions it keeps per query text, if any

    def describe(self) -> dict[str, Any]: ...

    def __call__(self, batch: Sequence[RouteQuery]) -> list[RouteAnswer]: ...

    def arm(self) -> None:
        """Start its injected faults (R4T_FAULT_*), once it serves: none by default."""

    def close(self) -> None:
        """Release what it holds beyond memory (an engine, a connection pool): none by
        default. Blocking: called off the event loop."""
