"""GRPO that scores each completion under the grammar it was sampled with.

TRL samples through our logits processor (training/stage1_fanout/grammar.py) but scores the sampled
tokens
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

from training.stage1_fanout.grammar import Grammar

# the masks kept (a step's policy and reference passes share them): T × V bools per completion,
# 12 MB each for an LLM's 152k-token vocabulary, so bounded by bytes, not rows
MASK_CACHE_BYTES = 2 * 1024**3


def masked_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, allowed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (B, T), entropies (B, T)) of `tokens` (B, T) under `logits` (B, T, V)
    renormalised over `allowed` (B, T, V). A token the mask did not allow (padding after
    <eos>, which the loss ignores) is scored unmasked, so nothing is −inf; both stay
    differentiable (masked entries get zero gradient, never NaN)."""
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)  # (B, T, V) never an empty row
    masked = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)  # (B, T, V)
    index = tokens.unsqueeze(-1)  # (B, T, 1)
    inside = allowed.gather(-1, index).squeeze(-1)  # (B, T)
    chosen = logits.gather(-1, index).squeeze(-1)  # (B, T)
    plain = chosen - torch.logsumexp(logits, dim=-1)  # (B, T)
    logps = torch.where(inside, masked.gather(-1, index).squeeze(-1), plain)  # (B, T)
    safe = masked.masked_fill(~allowed, 0.0)  # (B, T, V) no −inf left to multiply
    entropies = -(safe.exp().masked_fill(~allowed, 0.0) * safe).sum(dim=-1)  # (B, T)
    return logps, entropies


def fit_vocab(allowed: torch.Tensor, vocab: int) -> torch.Tensor:
    """(…, V) mask → (…, vocab): the tokenizer may count ids the model has no logit for (and a
    model may pad its vocabulary); ids past either end are never allowed."""
    width = allowed.shape[-1]
    if width >= vocab:
        return allowed[..., :vocab]
    return torch.nn.functional.pad(allowed, (0, vocab - width))


def completion_log_probs(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, allowed: torch.Tensor,
    temperature: float, batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked (log-probs, entropies), each (B, T), of the last T = allowed.shape[1] tokens of
    `input_ids` (B, P + T), laid out as TRL's fused head lays its own: logits at temperature,
    0 where `attention_mask` is 0 (after <eos>)."""
    width = allowed.shape[1]
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        rows = slice(start, start + batch_size)
        logits = model(input_ids=input_ids[rows], attention_mask=attention_mask[rows],
                       logits_to_keep=width + 1, use_cache=False).logits  # (b, T+1, V')
        logits = logits[:, :-1].float() / temperature  # (b, T, V'): position t predicts token t
        mask = fit_vocab(allowed[rows], logits.shape[-1]).to(logits.device)  # (b, T, V')
        lp, ent = masked_log_probs(logits, input_ids[rows, -width:], mask)
        pad = attention_mask[rows, -width:] == 0  # (b, T)
        logps.append(lp.masked_fill(pad, 0.0))
        entropies.append(ent.masked_fill(pad, 0.0))
    return torch.cat(logps), torch.cat(entropies)


class MaskedGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose per-token log-probabilities (policy and reference) are masked by
    `grammar` (set it to what `constrain_generation` returned; None scores as TRL does)."""

    grammar: Grammar | None = None
    _masks: dict[tuple[int, bytes], torch.Tensor] | None = None

    def _allowed(self, input_ids: torch.Tensor, completion_len: int) -> torch.Tensor:
        """(B, T, V) masks, replayed once per completion: the reference's and the policy's
        passes see the same rows, in another order and split (TRL shuffles the batch)."""
        cache = self._masks if self._masks is not None else {}
        ids = input_ids.cpu()
        keys = [(completion_len, row.numpy().tobytes()) for row in ids]
        missing = [i for i, key in enumerate(keys) if key not in cache]
        limit = max(len(keys), MASK_CACHE_BYTES // max(completion_len * self.grammar.vocab, 1))
        if missing and len(cache) + len(missing) > limit:
            cache = {}  # full: start afresh, and every row of this batch is now missing
            missing = list(range(len(keys)))
        if missing:
            fresh = self.grammar.allowed(ids[missing], completion_len)  # (m, T, V)
            cache.update({keys[i]: mask for i, mask in zip(missing, fresh, strict=True)})
        self._masks = cache
        return torch.stack([cache[key] for key in keys])  # (B, T, V)

    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
        logits_to_keep: int, batch_size: int | None = None, compute_entropy: bool = False,
        compute_aux_loss: bool = False, **extra: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if self.grammar is None or self.grammar.decoding == "free":
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **extra)
        if compute_aux_loss or any(v is not None for v in extra.values()):
            raise NotImplementedError("masked GRPO scores text-only, non-MoE policies")
        allowed = self._allowed(input_ids, logits_to_keep)  # (B, T, V)
        logps, entropies = completion_log_probs(
            model, input_ids, attention_mask, allowed, self.temperature,
            batch_size or input_ids.size(0))
        return logps, entropies if compute_entropy else None, None
