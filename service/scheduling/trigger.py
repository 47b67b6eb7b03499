"""When to fan out: `route=auto` answers a narrow query with `single` and fans out a broad one.

Ten complementary items pay only for a broad query ("vehicle"), not a narrow one ("golden
retriever"). Breadth is ln(1 + texts holding every searched word), from the lexical index alone
(microseconds, no labels); the threshold is chosen on val (`r4t eval --trigger-curve`). A query
fanned out leads with its own `lead` nearest items, so a narrow one judged broad keeps its item.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from service.artifacts.lexical import LexicalIndex

FanoutMode = Literal["auto", "always", "never"]
FANOUT_MODES: tuple[FanoutMode, ...] = ("auto", "always", "never")
# why a decision was taken: the score against the threshold, the request's fanout field, the
# request's A/B arm (single: nothing to fan out), or no lexical index to score with
REASONS = ("broad", "narrow", "always", "never", "arm", "no-lexical-index")


@dataclass(slots=True)
class Decision:
    fanout: bool
    reason: str  # one of REASONS
    score: float | None = None  # the query's breadth, when it was scored
    threshold: float | None = None
    lead: int = 0  # the query's own nearest items a fanned-out answer puts first


class FanoutTrigger:
    """Scores a query's breadth and decides whether its answer should be fanned out."""

    def __init__(self, lexical: LexicalIndex | None, threshold: float, lead: int = 0) -> None:
        self.lexical, self.threshold, self.lead = lexical, threshold, lead

    def score(self, text: str) -> float | None:
        """ln(1 + texts holding every searched word), None without a lexical index."""
        return None if self.lexical is None else math.log1p(self.lexical.breadth(text))

    def decide(self, text: str, mode: FanoutMode = "auto") -> Decision:
        if mode != "auto":
            return Decision(fanout=mode == "always", reason=mode)
        score = self.score(text)
        if score is None:  # nothing to tell narrow from broad with: the A/B arm answers
            return Decision(fanout=True, reason="no-lexical-index", lead=self.lead)
        broad = score >= self.threshold
        return Decision(broad, "broad" if broad else "narrow", score, self.threshold,
                        self.lead if broad else 0)

    def describe(self) -> dict[str, object]:
        return {"score": "ln(1 + catalog texts holding every query word the catalog uses)",
                "threshold": self.threshold, "lead": self.lead,
                "lexical_index": self.lexical is not None}
