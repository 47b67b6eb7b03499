"""Hostile inputs a caller can send cheaply, each a query text (and filter) at the API's
limits: one definition for the HTTP test (tests/service/api/test_hostile.py) and `make chaos`'s
`hostile` case, which sends them in a loop while it times /healthz."""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from typing import Any

from service.limits import MAX_BATCH_QUERIES, MAX_QUERY_CHARS
from service.routes import ROUTE_ORDER

ROUTES = ("auto", *ROUTE_ORDER)


def fill(unit: str) -> str:
    """`unit` repeated up to the query length limit."""
    return (unit * (MAX_QUERY_CHARS // len(unit) + 1))[:MAX_QUERY_CHARS].strip()


def never_seen(seed: int) -> str:
    """Words no catalog holds, up to the query length limit."""
    rng = random.Random(seed)
    words = ("".join(rng.choices(string.ascii_lowercase, k=9)) for _ in range(200))
    return " ".join(words)[:MAX_QUERY_CHARS].strip()


# kind -> (query text, filter or None)
HOSTILE: dict[str, tuple[str, dict[str, Any] | None]] = {
    "long": (fill("dog "), None),
    "frequent": (fill("of the a and in "), None),
    "never-seen": (never_seen(0), None),
    "fts5-syntax": (fill('NEAR(a b) OR "x" AND c* ^d -e {f} : '), None),
    "emoji-filter": ("dog", {"lemma": "😀 \\ \" ' naïve"}),
    "html": (fill("<script>alert(1)</script><b>dog</b> &amp; "), None),
    "punctuation": (fill("?!.,;:- "), None),
}


def hostile_batch(kind: str, seed: int = 0, routes: Sequence[str] = ROUTES) -> dict[str, Any]:
    """A /v1/retrieve:batch body at the batch limit: `kind`'s query spread over `routes` (the
    served ones: forcing a route not loaded is a 503 by design), never-seen words fresh per
    seed, so no cache answers them."""
    text, where = HOSTILE[kind]
    if kind == "never-seen":
        text = never_seen(seed)
    return {"queries": [{"query": text, "route": routes[i % len(routes)], "k": 10,
                         **({"filter": where} if where else {})}
                        for i in range(MAX_BATCH_QUERIES)]}
