"""GRPO's log-probabilities under the decoding grammar (training/stage1_fanout/grpo_trainer.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.fanout.format import build_prompt
from tests.training.stage1_fanout.test_policy import make_tiny_bundle, make_tiny_policy
from training.stage1_fanout.grammar import constrain_generation
from training.stage1_fanout.grpo_trainer import completion_log_probs, fit_vocab, masked_log_probs
from training.stage1_fanout.policy import load_policy

K = 10


def test_masked_log_probs_renormalise_over_the_allowed_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=gen)  # (B, T, V)
    allowed = torch.rand(2, 3, 7, generator=gen) > 0.5
    allowed[0, 0] = False
    allowed[0, 0, 4] = True  # a forced token
    tokens = torch.tensor([[4, 1, 2], [3, 5, 6]])
    for b in range(2):
        for t in range(3):
            allowed[b, t, tokens[b, t]] = True
    allowed[1, 2, tokens[1, 2]] = False  # e.g. padding after <eos>: scored unmasked
    logps, entropies = masked_log_probs(logits, tokens, allowed)
    for b in range(2):
        for t in range(3):
            tok = int(tokens[b, t])
            support = logits[b, t][allowed[b, t]] if allowed[b, t, tok] else logits[b, t]
            expected = logits[b, t, tok] - torch.logsumexp(support, dim=0)
            assert torch.isclose(logps[b, t], expected, atol=1e-5)
    assert torch.isclose(logps[0, 0], torch.tensor(0.0)) and entropies[0, 0] == 0
    assert (logps <= 0).all() and (entropies >= 0).all() and torch.isfinite(entropies).all()
    plain = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    assert (logps >= plain - 1e-6).all()  # a subset's share is never smaller
    weights = logits.clone().requires_grad_(True)
    lp, ent = masked_log_probs(weights, tokens, allowed)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(weights.grad).all()
    inside = allowed.gather(-1, tokens[..., None])  # (B, T, 1) rows scored under the mask
    assert (weights.grad[~allowed & inside] == 0).all()  # no gradient leaks to masked tokens
    assert (weights.grad[1, 2] != 0).all()  # the unmasked row (padding) spreads over all


def test_fit_vocab_cuts_or_pads_with_disallowed_ids() -> None:
    allowed = torch.ones(1, 2, 5, dtype=torch.bool)
    assert fit_vocab(allowed, 3).shape == (1, 2, 3)
    padded = fit_vocab(allowed, 7)
    assert padded.shape == (1, 2, 7) and not padded[..., 5:].any() and padded[..., :5].all()


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_policy(make_tiny_bundle(tmp_path_factory.mktemp("masked")))


def test_unmasked_scoring_matches_trls_fused_head(policy: Path) -> None:
    """With every token allowed, our scoring is TRL's: same positions, temperature, padding."""
    import copy

    from trl.trainer.utils import add_fused_lm_head

    model, tokenizer = load_policy(policy)
    enc = tokenizer([build_prompt("camping", ["tent", "boat", "lamp"])], return_tensors="pt")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, max_new_tokens=12, num_return_sequences=3,
                             pad_token_id=tokenizer.pad_token_id)
    width = out.shape[1] - enc["input_ids"].shape[1]
    mask = torch.ones_like(out)  # (B, P + T)
    mask[0, -width // 2 :] = 0  # a row padded after an early <eos>
    fused = copy.deepcopy(model)
    add_fused_lm_head(fused, temperature=0.7, outputs=("log_probs", "entropy"))
    labels = out.masked_fill(mask == 0, -100)
    labels[:, :-width] = -100
    with torch.no_grad():
        ref = fused(input_ids=out, attention_mask=mask, labels=labels, fused_lm_head=True)
        allowed = torch.ones(out.shape[0], width, len(tokenizer), dtype=torch.bool)
        logps, entropies = completion_log_probs(model, out, mask, allowed, 0.7, batch_size=2)
    assert torch.allclose(logps, ref.log_probs[:, -width:], atol=1e-5)
    assert torch.allclose(entropies, ref.entropy[:, -width:], atol=1e-4)
    assert (logps[0, -width // 2 :] == 0).all() and (logps[1] < 0).all()


def test_grammar_allows_every_token_it_sampled(policy: Path) -> None:
    """Replayed on the finished completions, the mask allowed each sampled token, and after
    the k-th line only <eos>."""
    model, tokenizer = load_policy(policy)
    names = ["tent", "boat", "tree", "stove", "lamp", "sleeping bag", "compass", "tarp",
             "hammock", "canteen", "lantern", "backpack"]
    grammar = constrain_generation(model, tokenizer, K, "context")
    enc = tokenizer([build_prompt("camping", names)], return_tensors="pt")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=80,
                             num_return_sequences=4, pad_token_id=tokenizer.pad_token_id)
    width = out.shape[1] - enc["input_ids"].shape[1]
    allowed = grammar.allowed(out, width)  # (B, T, V)
    assert allowed.shape == (4, width, len(tokenizer))
    completion = out[:, -width:]  # (B, T)
    newline = grammar.names.newline
    assert 1 <= int(allowed[0, 0].sum()) <= len(names)  # a line opens with a name's first token
    finished = 0
    for b in range(4):
        ends = (completion[b] == tokenizer.eos_token_id).nonzero()
        stop = int(ends[0]) + 1 if len(ends) else width  # through the first <eos>
        finished += len(ends) > 0
        assert all(allowed[b, t, completion[b, t]] for t in range(stop))
        breaks = (completion[b, :stop] == newline).nonzero()[:, 0]
        assert len(breaks) in (K - 1, K)  # the k-th name ends in a break or in <eos>
        if len(breaks) == K:  # after the k-th break only <eos>
            assert allowed[b, int(breaks[-1]) + 1].sum() == 1
            assert allowed[b, int(breaks[-1]) + 1, tokenizer.eos_token_id]
    assert finished == 4  # the grammar ends every row within the budget


class _CountingGrammar:
    """Stands in for `Grammar.allowed`: a mask that encodes its row's first token."""

    decoding = "lines"
    vocab = 8

    def __init__(self) -> None:
        self.rows = 0

    def allowed(self, ids: torch.Tensor, completion_len: int) -> torch.Tensor:
        self.rows += len(ids)
        masks = torch.zeros(len(ids), completion_len, 8, dtype=torch.bool)  # (m, T, V)
        masks[torch.arange(len(ids)), :, ids[:, 0] % 8] = True
        return masks


def test_mask_cache_refills_every_row_when_it_overflows(monkeypatch) -> None:
    import training.stage1_fanout.grpo_trainer as module

    monkeypatch.setattr(module, "MASK_CACHE_BYTES", 4 * 2 * 8)  # 4 rows of (T=2, V=8)
    trainer = module.MaskedGRPOTrainer.__new__(module.MaskedGRPOTrainer)
    trainer.grammar = _CountingGrammar()
    first = torch.tensor([[1, 9], [2, 9], [3, 9]])
    trainer._allowed(first, 2)
    assert trainer.grammar.rows == 3
    trainer._allowed(first[[2, 0]], 2)  # cached: the reference's pass, reordered
    assert trainer.grammar.rows == 3
    mixed = torch.tensor([[3, 9], [4, 9], [5, 9]])  # one cached row, two new: overflows 4
    masks = trainer._allowed(mixed, 2)  # (3, 2, 8)
    assert trainer.grammar.rows == 6  # the cached row is recomputed with the new ones
    assert masks[:, 0].nonzero()[:, 1].tolist() == [3, 4, 5]
