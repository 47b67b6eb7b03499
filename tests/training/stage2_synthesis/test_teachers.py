"""Stage 2 from item-picking teachers: the ranker sampled at a temperature, the labels as a
positive control, both among the student's ranked context."""

from __future__ import annotations

import numpy as np
import pytest

from service.artifacts.bundle import load_bundle
from service.ranker.ranker import RankedNeighbourhood, ScoredCandidates
from service.routes.diffusion import DiffusionContext
from service.runtime.encoder import Encoder
from training.data.splits import disjoint_train
from training.stage2_synthesis.dataset import load_dataset
from training.stage2_synthesis.synthesis import SynthesisConfig
from training.stage2_synthesis.teachers import oracle_block, ranker_block, synthesize_blocks


def test_an_oracle_block_takes_one_item_per_group_then_the_rest_in_order():
    ids = ["a1", "x", "a2", "b1", "y", "c1"]
    groups = [["a1", "a2"], ["b1"], ["c1"]]
    block = oracle_block(ids, groups, 5, np.random.default_rng(0))
    chosen = [ids[p] for p in block]
    group_of = {item: g for g, members in enumerate(groups) for item in members}
    assert sorted(group_of[i] for i in chosen[:3]) == [0, 1, 2]
    assert chosen[3:] == [i for i in ids if i not in chosen[:3]][:2]
    assert len(set(block)) == 5


def test_the_ranker_at_temperature_zero_is_its_served_choice(small_bundle_dir):
    bundle = load_bundle(small_bundle_dir)
    scored = ScoredCandidates(bundle)
    query = Encoder(bundle.encoder_config).encode(["tree"])
    [(rows, scores)] = scored(["tree"], query)
    embeddings = bundle.items.embeddings[rows]
    served = scored.ranker.choose(scores, embeddings, 5)
    assert ranker_block(scores, embeddings, scored, 5, 0.0, np.random.default_rng(1)) == served
    warm = {tuple(ranker_block(scores, embeddings, scored, 5, 0.9, np.random.default_rng(s)))
            for s in range(8)}
    assert len(warm) > 1  # a temperature samples


def test_blocks_lie_in_the_context_the_served_student_attends_to(small_bundle_dir, tmp_path):
    config = SynthesisConfig(samples_per_query=2, extra_queries=0, k=4)
    run = synthesize_blocks(small_bundle_dir, "oracle", config, 6, tmp_path / "run")
    data = load_dataset(run)
    labeled = disjoint_train(small_bundle_dir)
    assert data.queries == [q.query for q in labeled] and len(data) == 2 * len(labeled)
    bundle = load_bundle(small_bundle_dir)
    served = DiffusionContext(bundle, {"context": 6, "context_source": "ranked"})
    assert isinstance(served.prompt, RankedNeighbourhood)
    context = served.rows(data.queries, Encoder(bundle.encoder_config).encode(data.queries))
    for i, rows in zip(data.query_index, data.target_rows, strict=True):
        assert set(rows.tolist()) <= set(context[i].tolist())


@pytest.mark.parametrize("among", ["nearest", "mentioned"])
def test_a_standalone_student_s_blocks_lie_in_its_served_context(small_bundle_dir, tmp_path,
                                                                 among):
    config = SynthesisConfig(samples_per_query=1, extra_queries=0, k=4, temperature=0.0)
    run = synthesize_blocks(small_bundle_dir, "ranker", config, 12, tmp_path / "run", among)
    data = load_dataset(run)
    bundle = load_bundle(small_bundle_dir)
    served = DiffusionContext(bundle, {"context": 12, "context_source": among,
                                       "mention_words": {"before": [], "after": []}})
    context = served.rows(data.queries, Encoder(bundle.encoder_config).encode(data.queries))
    assert len(data) > 0
    for i, rows in zip(data.query_index, data.target_rows, strict=True):
        assert set(rows.tolist()) <= set(context[i].tolist())
