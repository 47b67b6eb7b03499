"""ONNX Runtime decoding with a KV cache: same greedy output and logits as PyTorch."""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from service.errors import DeadlineError
from service.fanout.decoding import (
    FanoutDecoder,
    line_grammar,
    lines_regex,
    sample_categorical,
)
from service.fanout.format import build_prompt
from training.stage1_fanout.export import export_folder
from training.stage1_fanout.policy import (
    POLICY_PRESETS,
    build_model,
    hf_tokenizer,
    load_policy,
    save_policy,
    tokenizer_corpus,
    train_tokenizer,
)

PROMPTS = [build_prompt("camping", ["tent", "camping tent"]), build_prompt("kitchen utensils"),
           build_prompt("a much longer query about musical instruments", ["violin"])]
TEXTS = ["tent, camping tent: gear for camping", "whisk: a kitchen utensil",
         "violin: a bowed musical instrument", "hammer: a hand tool"] * 10


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny random policy with large weights (so greedy output varies), exported."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("decoding")
    tok = train_tokenizer(tokenizer_corpus(TEXTS, ["camping"]), 384)
    config = POLICY_PRESETS["tiny"]
    model = build_model(config, tok, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.6)
    save_policy(model, hf_tokenizer(tok, config.max_positions), root / "ckpt",
                {"policy": asdict(config)})
    export_folder(root / "ckpt", root / "folm")
    return root / "ckpt", root / "folm"


def torch_greedy(checkpoint: Path, prompts: list[str], budget: int) -> list[str]:
    model, tokenizer = load_policy(checkpoint)
    texts = []
    for prompt in prompts:  # one at a time: no padding on the reference side
        enc = tokenizer([prompt], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=budget,
                                 pad_token_id=tokenizer.pad_token_id)
        texts.append(tokenizer.decode(out[0, enc["input_ids"].shape[1]:],
                                      skip_special_tokens=True))
    return texts


def test_greedy_parity_with_pytorch(exported: tuple[Path, Path]) -> None:
    checkpoint, folder = exported
    decoder = FanoutDecoder(folder, threads=1)
    budget = 20
    onnx_texts = [g.text for g in decoder.generate(PROMPTS, max_new_tokens=budget, max_lines=0)]
    reference = torch_greedy(checkpoint, PROMPTS, budget)
    assert onnx_texts == reference
    assert len(set("".join(reference))) > 3  # the fixture's model does not just repeat a token


def test_prompt_logits_match_pytorch(exported: tuple[Path, Path]) -> None:
    checkpoint, folder = exported
    decoder = FanoutDecoder(folder, threads=1)
    ids, mask = decoder._prompt_batch(PROMPTS)  # left-padded (B, P)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    logits, past = decoder._step(ids, mask, positions, decoder._empty_cache(len(PROMPTS)))
    model, _ = load_policy(checkpoint)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                    position_ids=torch.from_numpy(positions)).logits[:, -1].numpy()
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=1e-4)
    assert past["past_key.0"].shape[2] == ids.shape[1]


def test_graph_has_the_contract_io(exported: tuple[Path, Path]) -> None:
    _, folder = exported
    session = ort.InferenceSession(str(folder / "model.onnx"))
    inputs = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    assert inputs[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert "past_key.1" in inputs and "past_value.0" in inputs
    assert outputs[0] == "logits" and "present_value.1" in outputs


def test_sampling_is_seeded_and_budgeted(exported: tuple[Path, Path]) -> None:
    _, folder = exported
    decoder = FanoutDecoder(folder, threads=1)
    a = decoder.generate(PROMPTS, temperature=0.9, max_new_tokens=8, seed=1)
    b = decoder.generate(PROMPTS, temperature=0.9, max_new_tokens=8, seed=1)
    assert [g.text for g in a] == [g.text for g in b]
    assert all(1 <= g.n_tokens <= 8 for g in a)
    assert decoder.generate([]) == []


def test_sample_categorical_greedy_and_distribution() -> None:
    logits = np.log(np.array([[0.7, 0.2, 0.1]] * 4000))
    assert (sample_categorical(logits, 0.0, np.random.default_rng(0)) == 0).all()
    draws = sample_categorical(logits, 1.0, np.random.default_rng(0))
    assert abs((draws == 0).mean() - 0.7) < 0.03 and abs((draws == 2).mean() - 0.1) < 0.02


def test_decoding_stops_at_the_kth_line_break(exported: tuple[Path, Path]) -> None:
    _, folder = exported
    decoder = FanoutDecoder(folder, threads=1)
    ids = np.array(decoder.tokenizer.encode("tent\nstove\nlamp", add_special_tokens=False).ids)
    assert decoder._finish(ids, 2, 2).text == "tent\nstove"  # cut before the 2nd break
    assert decoder._finish(ids, 2, 0).text == "tent\nstove\nlamp"
    decoder.newlines[:] = 1  # every token a line break: rows stop after `stop` tokens
    cut = decoder.generate(PROMPTS, temperature=1.0, max_new_tokens=40, seed=5, max_lines=3,
                           enforce_lines=False)
    free = decoder.generate(PROMPTS, temperature=1.0, max_new_tokens=3, seed=5, max_lines=0)
    assert [g.n_tokens for g in cut] == [g.n_tokens for g in free]
    assert all(g.n_tokens <= 3 for g in cut)
    assert [g.text for g in cut] == [g.text for g in free]


class BreakHappyDecoder(FanoutDecoder):
    """Line breaks and <eos> boosted: unconstrained, rows end early and write empty lines."""

    def _step(self, *args: np.ndarray | dict) -> tuple[np.ndarray, dict]:
        logits, past = super()._step(*args)  # (B, V)
        logits = logits.copy()
        logits[:, self.newlines[: logits.shape[1]] > 0] += 6.0
        logits[:, int(self.config["eos_id"])] += 4.0
        return logits, past


def test_line_grammar_gives_exactly_k_non_empty_lines(exported: tuple[Path, Path]) -> None:
    _, folder = exported
    decoder = BreakHappyDecoder(folder, threads=1)
    prompts = PROMPTS * 8
    kwargs = {"temperature": 1.0, "max_new_tokens": 120, "seed": 1, "max_lines": 4}
    free = decoder.generate(prompts, enforce_lines=False, **kwargs)
    held = decoder.generate(prompts, **kwargs)

    def broken(text: str) -> bool:
        lines = text.split("\n")
        return len(lines) != 4 or not all(line.strip() for line in lines)

    assert sum(broken(g.text) for g in free) > len(prompts) // 4  # the bias does bite
    finished = [g for g in held if g.n_tokens < 120]
    assert len(finished) > len(prompts) // 2
    assert not [g.text for g in finished if broken(g.text)]


class CountingDecoder(FanoutDecoder):
    """Counts its model runs: the prompt's, then one per generated token."""

    steps = 0

    def _step(self, *args: np.ndarray | dict) -> tuple[np.ndarray, dict]:
        self.steps += 1
        return super()._step(*args)


def test_a_passed_deadline_stops_decoding_before_the_next_step(
        exported: tuple[Path, Path]) -> None:
    """Issue 41 item 3: past the batch's deadline no further step runs (a 504), both through
    the decoder and the AR path's ONNX backend; an unbounded call decodes as before."""
    from service.backends.onnx import OnnxFanoutBackend

    _, folder = exported
    decoder = CountingDecoder(folder, threads=1)
    kwargs = {"max_new_tokens": 12, "max_lines": 0}
    with pytest.raises(DeadlineError, match="fan-out decoding"):
        decoder.generate(PROMPTS, deadline=time.monotonic() - 1.0, **kwargs)
    assert decoder.steps == 1  # the prompt's run only: no token step after the deadline
    decoder.steps = 0
    unbounded = decoder.generate(PROMPTS, deadline=None, **kwargs)
    assert decoder.steps > 1
    assert [g.text for g in unbounded] == [g.text for g in decoder.generate(PROMPTS, **kwargs)]
    assert [g.text for g in decoder.generate(PROMPTS, deadline=time.monotonic() + 60.0,
                                             **kwargs)] == [g.text for g in unbounded]
    backend = OnnxFanoutBackend(decoder, 0.0, 12, 0, decoding="free")
    with pytest.raises(DeadlineError):
        backend.generate(PROMPTS, time.monotonic() - 1.0)
    assert [g.text for g in backend.generate(PROMPTS, None)] == [g.text for g in unbounded]


def test_line_grammar_masks() -> None:
    newlines = np.array([0, 0, 0, 1, 0])  # token 3 is a line break, 2 is <eos>
    logits = np.zeros((3, 5), dtype=np.float32)
    lines, open_line = np.array([0, 2, 2]), np.array([False, True, False])
    masked = line_grammar(logits, newlines, lines, open_line, stop=3, eos=2)
    assert np.isinf(masked[0, [2, 3]]).all() and np.isfinite(masked[0, [0, 1, 4]]).all()
    assert np.isfinite(masked[1]).all()  # last line with text: <eos> or a break both end it
    assert np.isinf(masked[2, [2, 3]]).all()  # last line still empty


def grammar_ends(text: str, k: int) -> bool:
    """Whether the served line grammar lets a completion write `text` then <eos>: tokens are
    characters ("a" text, " " blank, "\n" a break, "$" <eos>); after k breaks only <eos>."""
    vocab = ["a", " ", "\n", "$"]
    newlines = np.array([t.count("\n") for t in vocab])
    lines, open_line = 0, False
    for char in text + "$":
        if lines >= k:
            allowed = {"$"}
        else:
            masked = line_grammar(np.zeros((1, 4), np.float32), newlines, np.array([lines]),
                                  np.array([open_line]), stop=k, eos=3)[0]
            allowed = {t for t, v in zip(vocab, masked, strict=True) if np.isfinite(v)}
        if char not in allowed:
            return False
        lines, open_line = (lines + 1, False) if char == "\n" else \
            (lines, open_line or char == "a")
    return True


def test_lines_regex_is_the_line_grammar() -> None:
    """vLLM samples the accelerator recipe under the regex, the service decodes under the
    grammar: the same completions end under both (every text of up to 8 characters)."""
    pattern = re.compile(lines_regex(3))
    texts = ["".join(t) for n in range(9) for t in itertools.product("a \n", repeat=n)]
    accepted = [t for t in texts if pattern.fullmatch(t)]
    assert accepted and len(accepted) < len(texts)
    assert [t for t in texts if grammar_ends(t, 3)] == accepted
