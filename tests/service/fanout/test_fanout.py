"""The fan-out prompt and its catalog context: format, strict parsing, neighbour names."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from service.artifacts.bundle import Bundle, load_bundle
from service.fanout.candidates import Candidates
from service.fanout.format import (
    PromptBuilder,
    build_prompt,
    context_names,
    format_fanout,
    item_name,
    parse_fanout,
)
from service.runtime.encoder import Encoder


@pytest.fixture(scope="module")
def bundle(small_bundle_dir: Path) -> Bundle:
    return load_bundle(small_bundle_dir)


@pytest.fixture(scope="module")
def encoder(bundle: Bundle) -> Encoder:
    return Encoder(bundle.encoder_config)


def test_prompt_with_and_without_context() -> None:
    assert build_prompt("  camping   gear ") == "query: camping gear\nfan-out:\n"
    assert build_prompt("camping", ["tent", "camp stove"]) == (
        "query: camping\ncatalog: tent; camp stove\nfan-out:\n")


def test_parse_counts_lines_and_flags_extra_ones() -> None:
    names = [f"item {i}" for i in range(10)]
    exact = parse_fanout(format_fanout(names), 10)
    assert exact.well_formed and exact.n_lines == 10 and exact.valid.all()
    extra = parse_fanout(format_fanout([*names, "item 10"]), 10)
    assert extra.n_lines == 11 and not extra.well_formed and extra.valid.all()


def test_context_names_are_distinct_nearest_first_and_skip_the_query(
    bundle: Bundle, encoder: Encoder
) -> None:
    names = [item_name(t) for t in bundle.items.texts]
    query = names[0]
    emb = encoder.encode([query])  # (1, d)
    got = context_names(Candidates(bundle.index), names, [query], emb, 5)[0]
    assert len(got) == 5 and len({g.lower() for g in got}) == 5
    assert query.lower() not in {g.lower() for g in got}
    # best first: each name's best item similarity does not increase along the list
    best = []
    for name in got:
        rows = [i for i, n in enumerate(names) if n.lower() == name.lower()]
        best.append(float((bundle.items.embeddings[rows] @ emb[0]).max()))
    assert all(a >= b - 1e-6 for a, b in pairwise(best))
    assert context_names(Candidates(bundle.index), names, [''], emb, 0) == [[]]


def test_prompt_builder_puts_each_querys_own_neighbours_in_its_prompt(
    bundle: Bundle, encoder: Encoder
) -> None:
    texts = bundle.items.texts
    queries = [item_name(texts[3]), item_name(texts[len(texts) // 2])]
    emb = encoder.encode(queries)  # (2, d)
    prompts = PromptBuilder(Candidates(bundle.index), texts, 4).prompts(queries, emb)
    names = [item_name(t) for t in texts]
    for query, prompt, row in zip(queries, prompts, emb, strict=True):
        assert prompt.startswith(f"query: {query}\ncatalog: ")
        listed = prompt.split("catalog: ", 1)[1].split("\nfan-out:", 1)[0].split("; ")
        assert listed == context_names(Candidates(bundle.index), names, [query], row[None], 4)[0]
    assert PromptBuilder(Candidates(bundle.index), texts, 0).prompts(queries, emb) == [
        build_prompt(q) for q in queries]
    assert prompts[0].split("catalog: ")[1] != prompts[1].split("catalog: ")[1]
