import numpy as np
import pytest

from service.fanout.format import subquery_mask
from service.runtime.encoder import normalize
from training.data.metrics import vendi_score
from training.stage1_fanout.reward import RewardWeights, reward_terms


def test_vendi_of_identical_vectors_is_one():
    x = np.tile(normalize(np.array([[1.0, 2.0, 3.0]])), (5, 1))
    assert vendi_score(x[None])[0] == pytest.approx(1.0)


def test_vendi_of_orthogonal_vectors_is_n():
    assert vendi_score(np.eye(6)[None])[0] == pytest.approx(6.0)


def test_vendi_of_two_clusters_is_two():
    x = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    assert vendi_score(x[None])[0] == pytest.approx(2.0)


def test_vendi_mask_ignores_non_members():
    x = np.eye(4)
    mask = np.array([True, True, False, False])
    assert vendi_score(x[None], mask[None])[0] == pytest.approx(2.0)


def test_subquery_mask_marks_empty_and_duplicate_and_missing_slots():
    mask = subquery_mask(["tent", "", "Tent ", "stove"], k=6)
    assert mask.tolist() == [True, False, False, True, False, False]


def perfect_candidate(k: int) -> tuple[np.ndarray, np.ndarray]:
    """k orthogonal probes sitting exactly on k items, query equally close to all."""
    probes = np.eye(k + 1)[1:]  # (k, k+1)
    query = normalize(np.ones(k + 1))
    return query, probes


def test_reward_terms_by_hand():
    k = 4
    query, probes = perfect_candidate(k)
    terms = reward_terms(query, probes[None], np.ones((1, k), bool), np.ones((1, k)), probes[None])
    align = 1 / np.sqrt(k + 1)
    assert terms.ground[0] == pytest.approx(1.0)
    assert terms.diversity[0] == pytest.approx(1.0)  # Vendi = k, normalised (k-1)/(k-1)
    assert terms.alignment[0] == pytest.approx(align)
    assert terms.total[0] == pytest.approx(0.6 + 0.2 + 0.2 * align)


def test_collapsed_candidate_has_zero_diversity():
    k = 5
    query, probes = perfect_candidate(k)
    same = np.tile(probes[:1], (k, 1))
    terms = reward_terms(query, same[None], np.ones((1, k), bool), np.ones((1, k)), same[None])
    assert terms.diversity[0] == pytest.approx(0.0)


def test_malformed_candidates_score_below_well_formed():
    k = 4
    query, probes = perfect_candidate(k)
    group = np.stack([probes, probes, probes])  # (3, k, d)
    valid = np.array([[True] * 4, [True, True, False, False], [False] * 4])
    terms = reward_terms(query, group, valid, np.ones((3, k)), group)
    assert terms.total[0] > terms.total[1] > terms.total[2] == 0.0
    assert terms.n_valid.tolist() == [4, 2, 0]


def test_weights_are_configurable():
    k = 3
    query, probes = perfect_candidate(k)
    only_ground = RewardWeights(ground=1.0, diversity=0.0, alignment=0.0)
    terms = reward_terms(query, probes[None], np.ones((1, k), bool), np.full((1, k), 0.5),
                         probes[None], only_ground)
    assert terms.total[0] == pytest.approx(0.5)
