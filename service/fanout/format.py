"""The fan-out text format shared by the policy's training and the service's AR path.

The prompt's lines are `query: <text>`, `catalog: <name>; ...` and `fan-out:`; the completion is
exactly k lines, parsed strictly (a malformed slot scores 0 in GRPO's reward). The catalog
line names the query's first candidates (folm.json's `context`, `candidates`): a from-scratch
policy selects from the query's neighbourhood, as it cannot recall from nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.fanout.candidates import Candidates

PROMPT_TEMPLATE = "query: {query}\n{context}fan-out:\n"
CONTEXT_TEMPLATE = "catalog: {names}\n"
CONTEXT_SEPARATOR = "; "
SEPARATOR = "\n"
MAX_SUBQUERY_CHARS = 200
MAX_NEW_TOKENS = 160  # a fan-out's token budget, unless its policy or the settings give one


@dataclass(frozen=True)
class PromptRecipe:
    """How a fan-out is prompted by default: k sub-queries, written from the names of the
    query's first `context` candidates of the `candidates` source (service/fanout/candidates.py).
    The defaults of the from-scratch policy (PolicyConfig), the GGUF policy (LlamaConfig), the
    diffusion student's context (the `cpu` denoiser preset) and the hybrid-names baseline."""

    k: int = 10
    context: int = 24
    candidates: str = "hybrid"


PROMPT_RECIPE = PromptRecipe()


@dataclass
class Generation:
    """One fan-out completion as a backend returns it."""

    text: str  # the completion, special tokens removed
    n_tokens: int  # tokens generated (ONNX: <eos> included when produced; 0 when unknown)


def build_prompt(query: str, context: Sequence[str] = ()) -> str:
    """The policy's prompt; `context` is the query's nearest catalog names, best first."""
    names = CONTEXT_TEMPLATE.format(names=CONTEXT_SEPARATOR.join(context)) if context else ""
    return PROMPT_TEMPLATE.format(query=" ".join(query.split()), context=names)


def prompt_context(prompt: str) -> list[str]:
    """The catalog names a prompt carries (its catalog line), in order; [] without one."""
    head = CONTEXT_TEMPLATE.split("{", 1)[0]
    for line in prompt.split("\n"):
        if line.startswith(head):
            return [n for n in line[len(head):].split(CONTEXT_SEPARATOR) if n.strip()]
    return []


def prompt_query(prompt: str) -> str:
    """The query text a prompt was built for (its first line)."""
    head = PROMPT_TEMPLATE.split("{", 1)[0]
    first = prompt.split("\n", 1)[0]
    return first[len(head):] if first.startswith(head) else first


def item_name(text: str) -> str:
    """An item's first lemma: the text before the first comma or colon."""
    head = text.split(":", 1)[0]
    return head.split(",", 1)[0].strip()


def item_names(texts: Sequence[str]) -> list[str]:
    """Every item's name, row-aligned with `texts`."""
    return [item_name(t) for t in texts]


def context_names(
    candidates: Candidates, names: Sequence[str], texts: Sequence[str], query_emb: np.ndarray,
    n: int,
) -> list[list[str]]:
    """Up to n distinct names of each query's candidates (`service.fanout.candidates`), best first.

    texts: the query texts; query_emb: (Q, d). A name equal to its query's text
    (case-insensitively) is skipped: the fan-out should go beyond the query itself.
    """
    if n <= 0:
        return [[] for _ in range(len(query_emb))]
    out = []
    for text, row in zip(texts, candidates.rows(texts, query_emb, 3 * n), strict=True):
        skip = " ".join(text.lower().split())  # 3n rows: room for repeated names
        seen: dict[str, str] = {}
        for r in row:
            name = " ".join(names[r].split())
            key = name.lower()
            if key != skip and key not in seen and name:
                seen[key] = name
            if len(seen) == n:
                break
        out.append(list(seen.values()))
    return out


class PromptBuilder:
    """Query texts and embeddings → prompts with each query's `n` candidate catalog names."""

    def __init__(self, candidates: Candidates, item_texts: Sequence[str], n: int) -> None:
        self.candidates, self.n = candidates, int(n)
        self.names = item_names(item_texts) if self.n > 0 else []

    def prompts(self, queries: Sequence[str], query_emb: np.ndarray) -> list[str]:
        contexts = context_names(self.candidates, self.names, queries, query_emb, self.n)
        return [build_prompt(q, c) for q, c in zip(queries, contexts, strict=True)]


@dataclass
class ParsedFanout:
    subqueries: list[str]  # always k entries; "" in invalid slots
    valid: np.ndarray  # (k,) bool
    well_formed: bool  # exactly k non-empty, distinct, bounded lines
    n_lines: int = 0  # lines in the completion (more than k is malformed)

    @property
    def scored(self) -> np.ndarray:
        """(k,) the slots the reward counts: none when the completion runs past k lines.

        Serving still uses the first k lines (`valid`); training and evaluation score a
        rambling completion 0 so that "exactly k" is what the policy learns.
        """
        return self.valid if self.n_lines <= len(self.valid) else np.zeros_like(self.valid)


def parse_fanout(completion: str, k: int) -> ParsedFanout:
    """Split a completion into k sub-query slots and mark which slots are valid."""
    text = completion.strip()
    lines = [" ".join(line.split()) for line in text.split(SEPARATOR)] if text else []
    too_long = any(len(line) > MAX_SUBQUERY_CHARS for line in lines)
    slots = [line if len(line) <= MAX_SUBQUERY_CHARS else "" for line in lines[:k]]
    slots += [""] * (k - len(slots))
    valid = subquery_mask(slots, k)
    well_formed = len(lines) == k and bool(valid.all()) and not too_long
    return ParsedFanout(subqueries=slots, valid=valid, well_formed=well_formed,
                        n_lines=len(lines))


def subquery_mask(subqueries: list[str], k: int) -> np.ndarray:
    """(k,) bool: slot i is valid when present, non-empty and not a repeat of an earlier slot."""
    mask = np.zeros(k, dtype=bool)
    seen: set[str] = set()
    for i, text in enumerate(subqueries[:k]):
        key = " ".join(text.lower().split())
        if key and key not in seen:
            mask[i] = True
            seen.add(key)
    return mask


def format_fanout(subqueries: list[str]) -> str:
    """The completion text a well-formed fan-out is trained to produce."""
    return SEPARATOR.join(" ".join(s.split()) for s in subqueries)
