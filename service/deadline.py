"""A request's deadline as every blocking call under it reads it: `time.monotonic()` seconds,
None for unbounded (offline evaluation and benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from service.errors import DeadlineError


def latest(deadlines: Iterable[float | None]) -> float | None:
    """A batch's bound: its latest deadline (None when a request has none). Work stops only
    when no request can use it; a request whose own deadline passed gets its 504 from its
    batcher, not its batch-mates."""
    found = list(deadlines)
    return None if not found or None in found else max(d for d in found if d is not None)


def left_s(deadline: float | None, cap_s: float) -> float:
    """Seconds a call may take: `cap_s`, or less when the deadline comes first."""
    return cap_s if deadline is None else min(cap_s, deadline - time.monotonic())


def check(deadline: float | None, what: str) -> None:
    """Stop work whose answer can no longer arrive in time (DeadlineError, a 504)."""
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineError(f"the request deadline passed during {what}")
