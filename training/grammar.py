"""The fan-out grammars (k non-empty lines; lines that are catalog names) as HF logits processors.

The served ONNX decoder's constraint (`service.decoding.line_grammar`, the one rule both use),
for the torch side: GRPO's sampling (TRL's `GRPOTrainer` calls `model.generate`), the torch
synthesis backend and the ablation's samples. No <eos> before the k-th line or on an empty line,
no line break on an empty line, and <eos> forced once k lines are done (TRL cuts a completion at
its first <eos>). GRPO then spends its signal on what the lines say, not on counting them.
`NameGrammar` is `service.trie.name_grammar` likewise: each line one of the prompt's catalog
names ("context") or any catalog name ("catalog"), replayed from each row's tokens per step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from service.decoding import line_grammar, line_tables
from service.trie import NAME_SCOPES, NameConstraint, NameTrie, RowState, name_grammar


class LineGrammar(LogitsProcessor):
    """Masks the logits of one `generate` call; `prompt_len` is where completions start."""

    def __init__(self, newlines: np.ndarray, opens_line: np.ndarray, eos: int, k: int,
                 prompt_len: int) -> None:
        self.table = newlines  # (V,) line breaks per token, for `line_grammar`
        self.newlines = torch.from_numpy(newlines)  # (V,) int64
        self.opens_line = torch.from_numpy(opens_line)  # (V,) bool
        self.eos, self.k, self.prompt_len = eos, k, prompt_len

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, k: int, prompt_len: int) -> LineGrammar:
        newlines, opens_line = line_tables(tokenizer.decode, len(tokenizer))
        return cls(newlines, opens_line, int(tokenizer.eos_token_id), k, prompt_len)

    def state(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(lines so far (B,), current line has text (B,)) of the completions in `input_ids`."""
        new = input_ids[:, self.prompt_len :].clamp(max=len(self.newlines) - 1)  # (B, T)
        breaks = self.newlines[new]  # (B, T)
        position = torch.arange(new.shape[1], device=new.device).expand_as(new)  # (B, T)
        last_break = torch.where(breaks > 0, position, -1).max(dim=1, keepdim=True).values \
            if new.shape[1] else torch.full((new.shape[0], 1), -1)  # (B, 1)
        open_line = (self.opens_line[new] & (position >= last_break)).any(dim=1)  # (B,)
        return breaks.sum(dim=1), open_line

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        lines, open_line = self.state(input_ids)  # (B,), (B,)
        masked = line_grammar(scores.detach().float().cpu().numpy(), self.table, lines.numpy(),
                              open_line.numpy(), self.k, self.eos)  # (B, V)
        scores = torch.from_numpy(masked).to(scores.device, scores.dtype)
        done = lines >= self.k  # (B,) the k-th line break is the end: only <eos> remains
        scores[done] = -float("inf")
        scores[done, self.eos] = 0.0
        return scores


class NameGrammar(LogitsProcessor):
    """Every completion line one name of its prompt's tree; <eos> forced after k lines.

    The trees come from the prompts the first call sees (after `generate` has expanded them
    for `num_return_sequences`)."""

    def __init__(self, constraint: NameConstraint, tokenizer: Any, k: int,
                 prompt_len: int) -> None:
        self.constraint, self.tokenizer, self.k = constraint, tokenizer, k
        self.eos, self.prompt_len = constraint.eos, prompt_len
        self.tries: list[NameTrie | None] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.tries:
            prompts = self.tokenizer.batch_decode(input_ids[:, : self.prompt_len],
                                                  skip_special_tokens=True)
            self.tries = self.constraint.tries(prompts)
        newline = self.constraint.newline
        rows = input_ids[:, self.prompt_len :].tolist()
        states = [trie.replay(row) if trie is not None else RowState()
                  for trie, row in zip(self.tries, rows, strict=True)]
        lines = np.array([row.count(newline) for row in rows], dtype=np.int64)  # (B,)
        masked = name_grammar(scores.detach().float().cpu().numpy(), self.tries, states, lines,
                              self.k)  # (B, V)
        scores = torch.from_numpy(masked).to(scores.device, scores.dtype)
        done = torch.from_numpy(lines >= self.k)  # (B,) the k-th line break is the end
        scores[done] = -float("inf")
        scores[done, self.eos] = 0.0
        return scores


def constrain_generation(
    model: Any, tokenizer: Any, k: int, decoding: str = "lines", catalog_names: Any = (),
) -> Any:
    """Make `model.generate` decode as served (TRL offers no logits-processor hook).

    decoding: "lines" (`LineGrammar`), "context" or "catalog" (`NameGrammar`), "free" (as is).
    """
    if decoding == "free":
        return model
    original = model.generate
    base = LineGrammar.for_tokenizer(tokenizer, k, 0)
    names = NameConstraint(tokenizer.backend_tokenizer, int(tokenizer.eos_token_id), decoding,
                           catalog_names) if decoding in NAME_SCOPES else None

    def generate(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        width = int(ids.shape[1])
        grammar: LogitsProcessor = NameGrammar(names, tokenizer, k, width) if names else \
            LineGrammar(base.table, base.opens_line.numpy(), base.eos, k, width)
        kwargs["logits_processor"] = LogitsProcessorList(
            [grammar, *(kwargs.get("logits_processor") or [])])
        return original(*args, **kwargs)

    model.generate = generate
    return model
