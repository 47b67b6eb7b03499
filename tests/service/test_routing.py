"""A/B routing: weights, stickiness by user id, overrides, missing paths."""

from __future__ import annotations

import pytest

from service.routing import OVERRIDE_ARM, Router, stable_unit
from service.settings import parse_weights


def test_weights_parse_and_reject_nonsense():
    assert parse_weights("diffusion=0.9, ar=0.1") == {"diffusion": 0.9, "ar": 0.1}
    for bad in ("", "diffusion", "dense=1", "ar=-1", "ar=0,diffusion=0"):
        with pytest.raises(ValueError):
            parse_weights(bad)


def test_share_of_users_follows_the_weights():
    router = Router({"diffusion": 0.9, "ar": 0.1}, {"diffusion", "ar"})
    arms = [router.assign(f"user-{i}").arm for i in range(4000)]
    share = arms.count("ar") / len(arms)
    assert 0.07 < share < 0.13


def test_assignment_is_sticky_and_process_independent():
    a = Router({"diffusion": 0.5, "ar": 0.5}, {"diffusion", "ar"}, seed=1)
    b = Router({"ar": 0.5, "diffusion": 0.5}, {"diffusion", "ar"}, seed=2)
    for i in range(200):
        assert a.assign(f"u{i}") == b.assign(f"u{i}")
    assert stable_unit("u1") == stable_unit("u1") != stable_unit("u2")


def test_anonymous_requests_are_random_but_seedable():
    router = Router({"diffusion": 0.5, "ar": 0.5}, {"diffusion", "ar"}, seed=3)
    arms = {router.assign(None).arm for _ in range(100)}
    assert arms == {"diffusion", "ar"}


def test_override_wins_and_is_labelled():
    router = Router({"diffusion": 1.0}, {"diffusion", "ar"})
    assignment = router.assign("user-1", "ar")
    assert assignment.route == "ar" and assignment.arm == OVERRIDE_ARM
    assert router.assign("user-1", "auto").route == "diffusion"


def test_unloaded_arms_are_dropped():
    router = Router({"diffusion": 0.9, "ar": 0.1}, {"ar"})
    assert router.weights == {"ar": 1.0}
    assert {router.assign(f"u{i}").route for i in range(50)} == {"ar"}
