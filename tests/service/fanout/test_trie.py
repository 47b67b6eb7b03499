"""Catalog-name decoding: the prefix tree, its mask, and the ONNX decoder under it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.fanout.decoding import FanoutDecoder
from service.fanout.format import build_prompt, item_name, prompt_context
from service.fanout.trie import NameConstraint, NameTrie, RowState, name_grammar
from tests.service.fanout.test_decoding import TEXTS, exported  # noqa: F401 (fixture)

NEWLINE, EOS, VOCAB = 3, 2, 10
# names as token ids: "a b" (5 6), "a b c" (5 6 7), "d" (8)
TRIE = NameTrie([[5, 6], [5, 6, 7], [8]], newline=NEWLINE, eos=EOS)


def allowed(state: RowState, lines: int, stop: int = 3) -> set[int]:
    masked = name_grammar(np.zeros((1, VOCAB), np.float32), [TRIE], [state], np.array([lines]),
                          stop)
    return set(np.flatnonzero(np.isfinite(masked[0])).tolist())


def test_a_line_grows_along_names_and_ends_only_at_one() -> None:
    state = RowState()
    assert allowed(state, 0) == {5, 8}  # no empty line, no <eos>
    TRIE.advance(state, 5)
    assert allowed(state, 0) == {6}  # "a" is no name: it cannot end
    TRIE.advance(state, 6)
    assert allowed(state, 0) == {7, NEWLINE}  # "a b" may end or grow into "a b c"
    assert allowed(state, 2) == {7, NEWLINE, EOS}  # on the last line <eos> ends it too


def test_a_written_name_cannot_be_written_again() -> None:
    state = TRIE.replay([5, 6, NEWLINE])  # "a b" written
    assert state.node == 0 and allowed(state, 1) == {5, 8}  # "a b c" still open below "a"
    TRIE.advance(state, 5)
    TRIE.advance(state, 6)
    assert allowed(state, 1) == {7}  # "a b" again may not end: only "a b c"
    state = TRIE.replay([5, 6, NEWLINE, 5, 6, 7, NEWLINE])
    assert allowed(state, 2) == {8}  # every name under "a" is written: only "d" is left
    state = TRIE.replay([5, 6, NEWLINE, 5, 6, 7, NEWLINE, 8, NEWLINE])
    assert allowed(state, 3) == {5, 8}  # all written: repeating beats a row with no token


def test_tokens_off_the_tree_leave_the_row_unmasked() -> None:
    state = TRIE.replay([9])
    assert allowed(state, 0) == set(range(VOCAB))


def test_prompt_context_reads_back_the_catalog_line() -> None:
    names = ["tent", "camping tent", "sleeping bag"]
    assert prompt_context(build_prompt("camping", names)) == names
    assert prompt_context(build_prompt("camping")) == []


def context_decoder(folder: Path) -> tuple[FanoutDecoder, NameConstraint]:
    """An exported policy's decoder and its "context" name constraint."""
    decoder = FanoutDecoder(folder, threads=1)
    return decoder, NameConstraint(decoder.tokenizer, int(decoder.config["eos_id"]), "context")


def test_context_decoding_writes_distinct_names_of_its_own_prompt(
    exported: tuple[Path, Path],  # noqa: F811
) -> None:
    decoder, constraint = context_decoder(exported[1])
    contexts = [["tent", "camping tent", "whisk"], ["violin", "hammer", "bowed instrument"]]
    prompts = [build_prompt("camping", contexts[0]), build_prompt("music", contexts[1])] * 6
    gens = decoder.generate(prompts, temperature=1.0, max_new_tokens=60, seed=2, max_lines=3,
                            names=constraint)
    for prompt, gen in zip(prompts, gens, strict=True):
        lines = gen.text.split("\n")
        assert sorted(lines) == sorted(prompt_context(prompt))  # 3 lines: its 3 names, once
    free = decoder.generate(prompts, temperature=1.0, max_new_tokens=60, seed=2, max_lines=3)
    assert any(set(g.text.split("\n")) - set(prompt_context(p))
               for p, g in zip(prompts, free, strict=True))  # unconstrained, it strays
    bare = decoder.generate([build_prompt("camping")] * 4, temperature=1.0, max_new_tokens=60,
                            seed=3, max_lines=3, names=constraint)  # no names: lines only
    assert all(len(g.text.split("\n")) == 3 and all(g.text.split("\n")) for g in bare
               if g.n_tokens < 60)
    mixed = decoder.generate([prompts[0], build_prompt("camping")], temperature=1.0,
                             max_new_tokens=60, seed=2, max_lines=3, names=constraint)
    assert sorted(mixed[0].text.split("\n")) == sorted(contexts[0])  # its row kept its tree


def test_catalog_decoding_needs_the_names(exported: tuple[Path, Path]) -> None:  # noqa: F811
    decoder = FanoutDecoder(exported[1], threads=1)
    with pytest.raises(ValueError, match="item names"):
        NameConstraint(decoder.tokenizer, int(decoder.config["eos_id"]), "catalog", [])


def test_catalog_decoding_writes_item_names(exported: tuple[Path, Path]) -> None:  # noqa: F811
    _, folder = exported
    decoder = FanoutDecoder(folder, threads=1)
    names = {item_name(t) for t in TEXTS}
    constraint = NameConstraint(decoder.tokenizer, int(decoder.config["eos_id"]), "catalog",
                                names)
    gens = decoder.generate([build_prompt("camping")] * 8, temperature=1.0, max_new_tokens=60,
                            seed=4, max_lines=3, names=constraint)
    for gen in gens:
        lines = gen.text.split("\n")
        assert len(lines) == 3 and set(lines) <= names and len(set(lines)) == 3
