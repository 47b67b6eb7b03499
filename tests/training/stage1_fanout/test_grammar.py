"""The fan-out grammars as Hugging Face logits processors (GRPO's and torch synthesis' sampling)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tests.service.fanout.test_decoding import exported  # noqa: F401 (fixture)
from tests.training.stage1_fanout.test_policy import make_tiny_bundle, make_tiny_policy
from training.stage1_fanout.grammar import LineGrammar, constrain_generation
from training.stage1_fanout.policy import load_policy

K = 4


class BreakHappy(LogitsProcessor):
    """Boosts line breaks and <eos>: unconstrained, completions end early or hold empty lines."""

    def __init__(self, breaks: torch.Tensor, eos: int) -> None:
        self.breaks, self.eos = breaks, eos

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[:, self.breaks] += 5.0
        scores[:, self.eos] += 3.0
        return scores


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_policy(make_tiny_bundle(tmp_path_factory.mktemp("grammar")))


def sample(model, tokenizer, bias: LogitsProcessor, n: int = 24) -> list[str]:
    torch.manual_seed(0)
    enc = tokenizer(["query: tent\nfan-out:\n"] * n, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=80,
                             pad_token_id=tokenizer.pad_token_id,
                             logits_processor=LogitsProcessorList([bias]))
    new = out[:, enc["input_ids"].shape[1]:]  # (n, T)
    return [tokenizer.decode(row, skip_special_tokens=True) for row in new
            if (row == tokenizer.eos_token_id).any()]  # finished rows only


def broken(text: str) -> bool:
    lines = text.removesuffix("\n").split("\n")  # the k-th break, then the forced <eos>
    return len(lines) != K or not all(line.strip() for line in lines)


def test_constrained_generate_writes_exactly_k_lines(policy: Path) -> None:
    model, tokenizer = load_policy(policy)
    grammar = LineGrammar.for_tokenizer(tokenizer, K, 0)
    bias = BreakHappy(torch.nonzero(grammar.newlines > 0)[:, 0], grammar.eos)
    free = sample(model, tokenizer, bias)
    assert sum(broken(t) for t in free) > len(free) // 2  # the bias does bite
    constrain_generation(model, tokenizer, K)
    held = sample(model, tokenizer, bias)
    assert len(held) > 12 and not [t for t in held if broken(t)]


def test_line_grammar_masks_by_state() -> None:
    newlines = np.array([0, 0, 0, 1, 0])  # token 3 is a line break, 2 is <eos>
    opens = np.array([False, False, False, False, True])  # token 4 is text
    grammar = LineGrammar(newlines, opens, eos=2, k=2, prompt_len=1)
    ids = torch.tensor([[0, 0, 0, 0], [0, 4, 0, 0], [0, 4, 3, 4], [0, 4, 3, 4]])
    ids[3, 3] = 3  # two breaks: done
    lines, open_line = grammar.state(ids)
    assert lines.tolist() == [0, 0, 1, 2] and open_line.tolist() == [False, True, True, False]
    masked = grammar(ids, torch.zeros(4, 5))
    inf = torch.isinf(masked)
    assert inf[0, 2] and inf[0, 3]  # empty first line: no <eos>, no break
    assert inf[1, 2] and not inf[1, 3]  # first line has text: a break, not yet <eos>
    assert not inf[2, 2] and not inf[2, 3]  # last line with text: either ends it
    assert inf[3].sum() == 4 and not inf[3, 2]  # k breaks: only <eos>


def test_name_grammar_matches_the_served_decoder(
    exported: tuple[Path, Path],  # noqa: F811
) -> None:
    """HF `generate` under NameGrammar, the ONNX decoder under name_grammar: same greedy lines."""
    from service.fanout.format import build_prompt, prompt_context
    from tests.service.fanout.test_trie import context_decoder

    checkpoint, folder = exported
    decoder, served = context_decoder(folder)
    prompts = [build_prompt("camping", ["tent", "camping tent", "whisk", "violin"]),
               build_prompt("music", ["violin", "hammer", "tent", "bowed instrument"])]
    onnx = [g.text for g in decoder.generate(prompts, max_new_tokens=60, max_lines=3,
                                             names=served)]
    model, tokenizer = load_policy(checkpoint)
    constrain_generation(model, tokenizer, 3, "context")
    hf = []
    for prompt in prompts:  # one at a time: no padding on the reference side
        enc = tokenizer([prompt], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=60,
                                 pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        hf.append(text.removesuffix("\n"))  # the 3rd break, then the forced <eos>
    assert hf == onnx
    for prompt, text in zip(prompts, hf, strict=True):
        lines = text.split("\n")
        assert len(set(lines)) == 3 and set(lines) <= set(prompt_context(prompt))


def test_name_grammar_follows_expanded_prompts(policy: Path) -> None:
    """num_return_sequences expands the prompts after the processor is made."""
    from service.fanout.format import build_prompt

    model, tokenizer = load_policy(policy)
    names = ["tent", "boat", "tree", "stove", "lamp"]
    constrain_generation(model, tokenizer, K, "context")
    enc = tokenizer([build_prompt("camping", names)], return_tensors="pt")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=60,
                             num_return_sequences=6, pad_token_id=tokenizer.pad_token_id)
    for row in out[:, enc["input_ids"].shape[1]:]:
        lines = tokenizer.decode(row, skip_special_tokens=True).removesuffix("\n").split("\n")
        assert len(lines) == K and len(set(lines)) == K and set(lines) <= set(names)
