"""GRPO that scores each completion under the grammar it was sampled with.

TRL samples through our logits processor (training/grammar.py) but scores the sampled tokens
under the unconstrained softmax, for the policy, the reference and so the KL. A token the mask
forced can be improbable under both models, and the k3 KL estimate then measures the mask
more than the policy's drift (median 6.9 per token late in a 250-step run, 19,491 at worst).
Here both log-probabilities are taken over the tokens the grammar allowed at each position,
the distribution the policy actually sampled from. Hand-written: TRL's fused log-prob head
takes no logits processor (trl 1.16).
"""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOTrainer

from training.grammar import Grammar


def masked_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, allowed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (B, T), entropies (B, T)) of `tokens` (B, T) under `logits` (B, T, V)
    renormalised over `allowed` (B, T, V). A token the mask did not allow (padding after
    <eos>, which the loss ignores) is scored unmasked, so nothing is −inf."""
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)  # (B, T, V) never an empty row
    masked = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)  # (B, T, V)
    plain = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    index = tokens.unsqueeze(-1)  # (B, T, 1)
    inside = allowed.gather(-1, index).squeeze(-1)  # (B, T)
    logps = torch.where(inside, masked.gather(-1, index).squeeze(-1),
                        plain.gather(-1, index).squeeze(-1))  # (B, T)
    with torch.no_grad():  # a metric in TRL; kept out of the graph (0·−inf has no gradient)
        safe = masked.masked_fill(~allowed, 0.0)  # (B, T, V)
        entropies = -(safe.exp() * safe).masked_fill(~allowed, 0.0).sum(dim=-1)  # (B, T)
    return logps, entropies


def fit_vocab(allowed: torch.Tensor, vocab: int) -> torch.Tensor:
    """(…, V) mask → (…, vocab): the tokenizer may count ids the model has no logit for (and a
    model may pad its vocabulary); ids past either end are never allowed."""
    width = allowed.shape[-1]
    if width >= vocab:
        return allowed[..., :vocab]
    return torch.nn.functional.pad(allowed, (0, vocab - width))


class MaskedGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose per-token log-probabilities (policy and reference) are masked by
    `grammar` (set it to what `constrain_generation` returned; None scores as TRL does)."""

    grammar: Grammar | None = None
    _masks: tuple[int, torch.Tensor, torch.Tensor | None] | None = None

    def _allowed(self, input_ids: torch.Tensor, completion_len: int) -> torch.Tensor | None:
        """The grammar's masks for this batch, computed once for the policy and the reference."""
        if self.grammar is None:
            return None
        cached = self._masks
        if cached is not None and cached[0] == completion_len \
                and cached[1].shape == input_ids.shape and torch.equal(cached[1], input_ids):
            return cached[2]
        allowed = self.grammar.allowed(input_ids.cpu(), completion_len)  # (B, T, V)
        self._masks = (completion_len, input_ids.clone(), allowed)
        return allowed

    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
        logits_to_keep: int, batch_size: int | None = None, compute_entropy: bool = False,
        compute_aux_loss: bool = False, **extra: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        allowed = self._allowed(input_ids, logits_to_keep)
        if allowed is None or compute_aux_loss or any(v is not None for v in extra.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **extra)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            logits = model(input_ids=input_ids[rows], attention_mask=attention_mask[rows],
                           logits_to_keep=logits_to_keep + 1).logits  # (b, T+1, V')
            logits = logits[:, :-1].float() / self.temperature  # (b, T, V'): predicts tokens
            mask = fit_vocab(allowed[rows], logits.shape[-1]).to(logits.device)  # (b, T, V')
            lp, ent = masked_log_probs(logits, input_ids[rows, -logits_to_keep:], mask)
            logps.append(lp)
            entropies.append(ent)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None
