"""The fan-out grammar (exactly k non-empty lines) as a Hugging Face logits processor.

The served ONNX decoder's constraint (`service.decoding.line_grammar`, the one rule both use),
for the torch side: GRPO's sampling (TRL's `GRPOTrainer` calls `model.generate`), the torch
synthesis backend and the ablation's samples. No <eos> before the k-th line or on an empty line,
no line break on an empty line, and <eos> forced once k lines are done (TRL cuts a completion at
its first <eos>). GRPO then spends its signal on what the lines say, not on counting them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from service.decoding import line_grammar, line_tables


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


def constrain_generation(model: Any, tokenizer: Any, k: int) -> Any:
    """Make `model.generate` apply `LineGrammar` (TRL offers no logits-processor hook)."""
    original = model.generate
    base = LineGrammar.for_tokenizer(tokenizer, k, 0)

    def generate(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        grammar = LineGrammar(base.table, base.opens_line.numpy(), base.eos, k, int(ids.shape[1]))
        kwargs["logits_processor"] = LogitsProcessorList(
            [grammar, *(kwargs.get("logits_processor") or [])])
        return original(*args, **kwargs)

    model.generate = generate
    return model
