"""Candidate generation by source, on the small real bundle."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from service.artifacts.bundle import load_bundle
from service.errors import BundleError
from service.fanout.candidates import RRF_K, candidate_rows, fuse, fuse_each
from service.runtime.encoder import Encoder
from service.runtime.index import search


@pytest.fixture(scope="module")
def bundle(small_bundle_dir):
    return load_bundle(small_bundle_dir)


def test_sources_dense_lexical_and_their_fusion(bundle):
    texts = ["dog", "musical instrument"]
    queries = Encoder(bundle.encoder_config).encode(texts)
    dense = candidate_rows(bundle, texts, queries, 30, "dense")
    lexical = candidate_rows(bundle, texts, queries, 30, "lexical")
    hybrid = candidate_rows(bundle, texts, queries, 30, "hybrid")
    assert np.array_equal(np.stack(dense), search(bundle.index, queries, 30)[1])
    agreed = 0
    for d, lex, h in zip(dense, lexical, hybrid, strict=True):
        assert len(h) == len(set(h.tolist())) == 30
        assert set(h.tolist()) <= set(d.tolist()) | set(lex.tolist())
        both = [r for r in d.tolist() if r in set(lex.tolist())]
        if both:  # found by both sources: ranked first
            assert h[0] in both
            agreed += 1
    assert agreed  # the rule was exercised


def test_fusion_ranks_by_summed_reciprocal_rank():
    assert fuse([np.array([1, 2, 3]), np.array([3, 4])], 3).tolist() == [3, 1, 2]


def test_fusion_is_the_running_sum_with_ties_in_first_seen_order():
    rng = np.random.default_rng(0)
    for _ in range(200):  # rankings over few rows: many shared rows and tied scores
        rankings = [rng.choice(30, size=rng.integers(0, 25), replace=False) for _ in range(2)]
        score: dict[int, float] = {}
        for ranking in rankings:
            for rank, row in enumerate(ranking.tolist()):
                score[row] = score.get(row, 0.0) + 1.0 / (RRF_K + rank + 1)
        expected = sorted(score, key=lambda row: -score[row])[:20]  # stable: first seen first
        assert fuse(rankings, 20).tolist() == expected
    assert fuse([], 5).tolist() == []


def running_sum_fusion(rankings: list[np.ndarray], n: int) -> list[int]:
    score: dict[int, float] = {}
    for ranking in rankings:
        for rank, row in enumerate(ranking.tolist()):
            score[row] = score.get(row, 0.0) + 1.0 / (RRF_K + rank + 1)
    return sorted(score, key=lambda row: -score[row])[:n]  # stable: first seen first


def test_a_batch_fuses_as_its_queries_one_by_one():
    rng = np.random.default_rng(1)
    batch = [[rng.choice(40, size=rng.integers(0, 25), replace=False) for _ in range(2)]
             for _ in range(60)]  # some queries with an empty source, or two
    fused = fuse_each([[q[0] for q in batch], [q[1] for q in batch]], 12)
    assert [f.tolist() for f in fused] == [running_sum_fusion(q, 12) for q in batch]
    assert fuse_each([[], []], 5) == []
    with pytest.raises(ValueError, match="one each"):
        fuse_each([[np.array([1])], []], 5)


def test_lexical_sources_need_the_index_and_sources_are_checked(bundle):
    queries = Encoder(bundle.encoder_config).encode(["dog"])
    with pytest.raises(BundleError, match="unknown candidate source"):
        candidate_rows(bundle, ["dog"], queries, 5, "nearest")
    bare = type(bundle)(bundle.path, bundle.manifest, bundle.items, bundle.index, None)
    with pytest.raises(BundleError, match="lexical index"):
        candidate_rows(bare, ["dog"], queries, 5, "hybrid")


def test_teacher_prompt_student_context_and_served_routes_share_one_candidate_list(bundle):
    """The teacher's GRPO prompt, the served AR prompt and the diffusion context name the same
    items for a query when they record the same source: one definition, not three."""
    from service.fanout.format import item_name, prompt_context
    from service.fanout.grounding import NameGrounding, name_key
    from service.routes.autoregressive import AutoregressiveRoute
    from service.routes.diffusion import DiffusionContext
    from training.stage1_fanout.grpo import FanoutScorer

    # names of an item and of several (shared names ground by the query), free text
    texts = ["dog", "musical instrument", "bass", "Tree", "head of state", "water"]
    encoder = Encoder(bundle.encoder_config)
    queries = encoder.encode(texts)
    scorer = FanoutScorer(bundle, encoder, 10)
    teacher = scorer.prompts(texts, {"context": 16, "candidates": "hybrid"})
    served = AutoregressiveRoute(bundle, encoder, backend=None, fanout_k=10, context=16,
                                candidates="hybrid")
    assert served.prompt_builder.prompts(texts, queries) == teacher
    student = DiffusionContext(bundle, {"context": 16, "context_source": "prompt",
                                        "candidates": "hybrid"}).rows(texts, queries)  # (6, 16)
    grounding = NameGrounding(bundle.items.texts, bundle.items.embeddings)
    owners = Counter(name_key(item_name(t)) for t in bundle.items.texts)
    named = [name_key(n) for prompt in teacher for n in prompt_context(prompt)]
    assert any(owners[key] > 1 for key in named)  # some names are several items'
    for prompt, rows, query, text in zip(teacher, student, queries, texts, strict=True):
        names = prompt_context(prompt)
        assert text.lower() not in {name.lower() for name in names}  # the query's own skipped
        grounded = grounding.rows(names, np.repeat(query[None], len(names), axis=0))
        assert np.resize(grounded, 16).tolist() == rows.tolist()
    # the source is carried, not ignored: the dense prompt of the same size names other items
    assert scorer.prompts(texts, {"context": 6}) != teacher
