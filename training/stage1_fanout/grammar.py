"""The fan-out grammars (k non-empty lines; lines that are catalog names) as HF logits processors.

The served ONNX decoder's constraint (`service.fanout.decoding.line_grammar`, the one rule both
use),
for the torch side: GRPO's sampling (TRL's `GRPOTrainer` calls `model.generate`), the torch
synthesis backend and the ablation's samples. No <eos> before the k-th line or on an empty line,
no line break on an empty line, and <eos> forced once k lines are done (TRL cuts a completion at
its first <eos>). GRPO then spends its signal on what the lines say, not on counting them.
`NameGrammar` is `service.fanout.trie.name_grammar` likewise: each line one of the prompt's catalog
names ("context") or any catalog name ("catalog"), replayed from each row's tokens per step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from service.fanout.decoding import line_grammar, line_tables
from service.fanout.trie import NAME_SCOPES, NameConstraint, NameTrie, RowState, name_grammar


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
        """(lines so far (B,), current line has text (B,)) of the completions in `input_ids`,
        on the CPU, where the tables are (`generate` may run on a GPU)."""
        new = input_ids[:, self.prompt_len :].cpu().clamp(max=len(self.newlines) - 1)  # (B, T)
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
        done = (lines >= self.k).to(scores.device)  # (B,) the k-th break ends: only <eos> left
        scores[done] = -float("inf")
        scores[done, self.eos] = 0.0
        return scores


class NameGrammar(LogitsProcessor):
    """Every completion line one name of its prompt's tree; <eos> forced after k lines.

    The trees come from the prompts the first call sees (after `generate` has expanded them
    for `num_return_sequences`); one instance serves one batch, its calls in order."""

    def __init__(self, constraint: NameConstraint, tokenizer: Any, k: int,
                 prompt_len: int) -> None:
        self.constraint, self.tokenizer, self.k = constraint, tokenizer, k
        self.eos, self.prompt_len = constraint.eos, prompt_len
        self.tries: list[NameTrie | None] = []
        self.states: list[RowState] = []
        self.lines = np.zeros(0, dtype=np.int64)  # (B,) line breaks so far
        self.seen = 0  # completion tokens already replayed into `states`

    def _catch_up(self, input_ids: torch.LongTensor) -> None:
        """Advance each row's state over the tokens added since the last call (one per step
        in `generate`), so a completion is replayed once, not once per step."""
        if not self.tries:
            prompts = self.tokenizer.batch_decode(input_ids[:, : self.prompt_len],
                                                  skip_special_tokens=True)
            self.tries = self.constraint.tries(prompts)
            self.states = [RowState() for _ in self.tries]
            self.lines = np.zeros(len(self.tries), dtype=np.int64)
        new = input_ids[:, self.prompt_len + self.seen :].cpu().tolist()  # (B, new tokens)
        for trie, state, tokens in zip(self.tries, self.states, new, strict=True):
            for token in (tokens if trie is not None else ()):
                trie.advance(state, token)
        self.lines += np.array([row.count(self.constraint.newline) for row in new], np.int64)
        self.seen = input_ids.shape[1] - self.prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._catch_up(input_ids)
        lines = self.lines
        masked = name_grammar(scores.detach().float().cpu().numpy(), self.tries, self.states,
                              lines, self.k)  # (B, V)
        scores = torch.from_numpy(masked).to(scores.device, scores.dtype)
        done = torch.from_numpy(lines >= self.k).to(scores.device)  # (B,) the k-th break ends
        scores[done] = -float("inf")
        scores[done, self.eos] = 0.0
        return scores


class Grammar:
    """The served decoding's logits processor for each batch, and the tokens it allows.

    decoding: "lines" (`LineGrammar`), "context" or "catalog" (`NameGrammar`), "free" (none).
    """

    def __init__(self, tokenizer: Any, k: int, decoding: str = "lines",
                 catalog_names: Any = ()) -> None:
        self.tokenizer, self.k, self.decoding = tokenizer, k, decoding
        self.lines = LineGrammar.for_tokenizer(tokenizer, k, 0) if decoding == "lines" else None
        self.names = NameConstraint(tokenizer.backend_tokenizer, int(tokenizer.eos_token_id),
                                    decoding, catalog_names) if decoding in NAME_SCOPES else None

    @property
    def vocab(self) -> int:
        """Tokens a mask of `allowed` has per position."""
        return len(self.tokenizer)

    def processor(self, prompt_len: int) -> LogitsProcessor | None:
        """A fresh processor for one `generate` call whose prompts are `prompt_len` wide."""
        if self.decoding == "free":
            return None
        if self.names is not None:
            return NameGrammar(self.names, self.tokenizer, self.k, prompt_len)
        base = self.lines
        assert base is not None  # "lines" decoding
        return LineGrammar(base.table, base.opens_line.numpy(), base.eos, self.k, prompt_len)

    def allowed(self, input_ids: torch.Tensor, completion_len: int) -> torch.Tensor | None:
        """(B, T, V) bool: the tokens the grammar allowed at each of the last T positions of
        `input_ids` (B, P + T), replayed as `generate` saw them; None when decoding is free."""
        prompt_len = input_ids.shape[1] - completion_len
        grammar = self.processor(prompt_len)
        if grammar is None:
            return None
        zeros = torch.zeros((input_ids.shape[0], self.vocab))  # (B, V)
        steps = [torch.isfinite(grammar(input_ids[:, : prompt_len + t], zeros.clone()))
                 for t in range(completion_len)]  # T × (B, V)
        return torch.stack(steps, dim=1)  # (B, T, V)


def constrain_generation(
    model: Any, tokenizer: Any, k: int, decoding: str = "lines", catalog_names: Any = (),
) -> Grammar:
    """Make `model.generate` decode as served (TRL offers no logits-processor hook); returns
    the grammar, whose `allowed` masks let training score completions as they were sampled."""
    grammar = Grammar(tokenizer, k, decoding, catalog_names)
    if decoding == "free":
        return grammar
    original = model.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        kwargs["logits_processor"] = LogitsProcessorList(
            [grammar.processor(int(ids.shape[1])), *(kwargs.get("logits_processor") or [])])
        return original(*args, **kwargs)

    model.generate = generate
    return grammar
