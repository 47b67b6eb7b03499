"""A request's deadline as every blocking call under it reads it: `time.monotonic()` seconds,
None for unbounded (offline evaluation and benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from service.errors import DeadlineError


def earliest(deadlines: Iterable[float | None]) -> float | None:
    """The batch's bound: its earliest deadline (None when no request has one)."""
    bounded = [d for d in deadlines if d is not None]
    return min(bounded) if bounded else None


def left_s(deadline: float | None, cap_s: float) -> float:
    """Seconds a call may take: `cap_s`, or less when the deadline comes first."""
    return cap_s if deadline is None else min(cap_s, deadline - time.monotonic())


def check(deadline: float | None, what: str) -> None:
    """Stop work whose answer can no longer arrive in time (DeadlineError, a 504)."""
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineError(f"the request deadline passed during {what}")
