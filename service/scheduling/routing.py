"""A/B routing between the retrieval paths, weights from settings (e.g. `ranked=0.9,ar=0.1`).

A `user_id` picks its arm by a stable hash (the same arm across processes and restarts); without
one the arm is random; a named route overrides the weights (arm "override"). Arms not loaded
are left out and the weights renormalised; with none, the best loaded route (ROUTE_ORDER).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from service.routes import ROUTE_ORDER

OVERRIDE_ARM = "override"


@dataclass(frozen=True)
class Assignment:
    route: str  # the route asked to answer
    arm: str  # the A/B arm (a route name) or "override"


def stable_unit(key: str) -> float:
    """A uniform number in [0, 1) from a string, identical in every process."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class Router:
    """Picks the arm of each request."""

    def __init__(
        self, weights: dict[str, float], available: set[str], seed: int | None = None
    ) -> None:
        live = {name: w for name, w in sorted(weights.items()) if name in available and w > 0}
        if not live:  # configured arms absent: the best route that is loaded
            best = [name for name in ROUTE_ORDER if name in available][:1]
            live = {name: 1.0 for name in best}
        total = sum(live.values())
        self.weights = {name: w / total for name, w in live.items()}
        self._rng = random.Random(seed)

    def assign(self, user_id: str | None, override: str | None = None) -> Assignment:
        if override and override != "auto":
            return Assignment(route=override, arm=OVERRIDE_ARM)
        if not self.weights:
            return Assignment(route="diffusion", arm="diffusion")
        u = stable_unit(f"r4t-ab:{user_id}") if user_id is not None else self._rng.random()
        cumulative = 0.0
        for name, weight in self.weights.items():
            cumulative += weight
            if u < cumulative:
                return Assignment(route=name, arm=name)
        last = next(reversed(self.weights))
        return Assignment(route=last, arm=last)
