"""The fan-out text format shared by the policy's training and the service's AR path.

Prompt: "query: <query text>\nfan-out:\n"; completion: exactly k sub-queries, one per line,
then the end-of-sequence token. Parsing is strict: anything else is malformed, and a
malformed completion's missing slots score 0 in the reward (see service/reward.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.reward import subquery_mask

PROMPT_TEMPLATE = "query: {query}\nfan-out:\n"
SEPARATOR = "\n"
MAX_SUBQUERY_CHARS = 200


def build_prompt(query: str) -> str:
    return PROMPT_TEMPLATE.format(query=" ".join(query.split()))


@dataclass
class ParsedFanout:
    subqueries: list[str]  # always k entries; "" in invalid slots
    valid: np.ndarray  # (k,) bool
    well_formed: bool  # exactly k non-empty, distinct, bounded lines


def parse_fanout(completion: str, k: int) -> ParsedFanout:
    """Split a completion into k sub-query slots and mark which slots are valid."""
    text = completion.strip()
    lines = [" ".join(line.split()) for line in text.split(SEPARATOR)] if text else []
    too_long = any(len(line) > MAX_SUBQUERY_CHARS for line in lines)
    slots = [line if len(line) <= MAX_SUBQUERY_CHARS else "" for line in lines[:k]]
    slots += [""] * (k - len(slots))
    valid = subquery_mask(slots, k)
    well_formed = len(lines) == k and bool(valid.all()) and not too_long
    return ParsedFanout(subqueries=slots, valid=valid, well_formed=well_formed)


def format_fanout(subqueries: list[str]) -> str:
    """The completion text a well-formed fan-out is trained to produce."""
    return SEPARATOR.join(" ".join(s.split()) for s in subqueries)
