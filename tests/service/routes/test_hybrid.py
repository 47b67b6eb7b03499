"""The `hybrid` route: the hybrid candidate list's first k names, no model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from service.artifacts.bundle import load_bundle
from service.errors import BundleError
from service.fanout.format import item_names
from service.routes.answer import RouteQuery
from service.routes.hybrid import HybridRoute
from service.routes.single import SingleRoute
from service.runtime.encoder import Encoder


@pytest.fixture(scope="module")
def route(small_bundle_dir: Path) -> HybridRoute:
    bundle = load_bundle(small_bundle_dir)
    return HybridRoute(bundle, Encoder(bundle.encoder_config))


def test_it_answers_the_prompts_first_k_names_without_the_querys_own(route, benchmark_queries):
    texts = [q.query for q in benchmark_queries[:4]]
    prompts = route.lookup.rows(texts, route.encoder.encode(texts))  # (4, context)
    names = item_names(route.bundle.items.texts)
    single = SingleRoute(route.bundle, route.encoder)([RouteQuery(t, 10) for t in texts])
    for text, prompt, answer, nearest in zip(texts, prompts, route([RouteQuery(t, 10)
                                                                    for t in texts]),
                                             single, strict=True):
        first = list(dict.fromkeys(prompt.tolist()))[:10]
        assert answer.selection.rows[: len(first)] == first
        assert len(set(answer.selection.rows)) == 10
        assert text not in {names[r] for r in answer.selection.rows}
        assert answer.selection.rows != nearest.selection.rows


def test_a_k_past_the_prompt_gets_k_distinct_items(route):
    [answer] = route([RouteQuery("tree", 40)])
    assert len(set(answer.selection.rows)) == 40


def test_a_bundle_without_a_lexical_index_has_no_hybrid_route(route):
    """A catalog-only bundle built before the lexical stage existed, say."""
    with pytest.raises(BundleError, match="lexical"):
        HybridRoute(replace(route.bundle, lexical=None), route.encoder)
