"""The fan-out grammar (exactly k non-empty lines) as a Hugging Face logits processor.

The same constraint as the served ONNX decoder (`service.decoding.FanoutDecoder.line_grammar`),
for the torch side: GRPO's sampling (TRL's `GRPOTrainer` calls `model.generate`), the torch
synthesis backend and the ablation's samples. No <eos> before the k-th line or on an empty line,
no line break on an empty line, and <eos> forced once k lines are done (TRL cuts a completion at
its first <eos>). GRPO then spends its signal on what the lines say, not on counting them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList


class LineGrammar(LogitsProcessor):
    """Masks the logits of one `generate` call; `prompt_len` is where completions start."""

    def __init__(self, newlines: torch.Tensor, opens_line: torch.Tensor, eos: int, k: int,
                 prompt_len: int) -> None:
        self.newlines, self.opens_line = newlines, opens_line  # (V,) int64, (V,) bool
        self.eos, self.k, self.prompt_len = eos, k, prompt_len

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, k: int, prompt_len: int) -> LineGrammar:
        vocab = len(tokenizer)
        texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(vocab)]
        plain = [tokenizer.decode([i], skip_special_tokens=True) for i in range(vocab)]
        newlines = torch.tensor([t.count("\n") for t in texts], dtype=torch.long)  # (V,)
        opens = torch.tensor([bool(t.rsplit("\n", 1)[-1].strip()) for t in plain])  # (V,)
        return cls(newlines, opens, int(tokenizer.eos_token_id), k, prompt_len)

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
        vocab = min(scores.shape[1], len(self.newlines))
        scores = scores.clone()  # (B, V)
        is_break = torch.zeros(scores.shape[1], dtype=torch.bool)
        is_break[:vocab] = self.newlines[:vocab] > 0
        scores[(~open_line)[:, None] & is_break[None, :]] = -float("inf")
        scores[(lines < self.k - 1) | ~open_line, self.eos] = -float("inf")
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
        grammar = LineGrammar(base.newlines, base.opens_line, base.eos, k, int(ids.shape[1]))
        kwargs["logits_processor"] = LogitsProcessorList(
            [grammar, *(kwargs.get("logits_processor") or [])])
        return original(*args, **kwargs)

    model.generate = generate
    return model
