"""A/B routing: weights, stickiness by user id, overrides, missing paths."""

from __future__ import annotations

import pytest

from service.routes import ROUTE_ORDER
from service.scheduling.routing import OVERRIDE_ARM, Router, stable_unit
from service.settings import parse_weights

BOTH = {"diffusion": 0.5, "ar": 0.5}
DRAWS = 200


def anonymous_arms(router: Router, n: int = DRAWS) -> list[str]:
    return [router.assign(None).arm for _ in range(n)]


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
    """A user's arm depends on the user id alone: not on the seed, the order the weights
    were written in, the instance, or how many requests came before."""
    a = Router(BOTH, {"diffusion", "ar"}, seed=1)
    b = Router({"ar": 0.5, "diffusion": 0.5}, {"diffusion", "ar"}, seed=2)
    users = [f"u{i}" for i in range(DRAWS)]
    first = [a.assign(u).arm for u in users]
    anonymous_arms(a, 37)  # anonymous draws in between move a's generator, not the users
    assert [a.assign(u).arm for u in reversed(users)] == first[::-1]
    assert [b.assign(u).arm for u in users] == first
    assert set(first) == {"diffusion", "ar"}  # the users really are split
    assert stable_unit("u1") == stable_unit("u1") != stable_unit("u2")


def test_anonymous_requests_are_random_but_seedable():
    arms = anonymous_arms(Router(BOTH, {"diffusion", "ar"}, seed=3))
    assert set(arms) == {"diffusion", "ar"}
    assert 0.35 < arms.count("ar") / len(arms) < 0.65
    assert anonymous_arms(Router(BOTH, {"diffusion", "ar"}, seed=3)) == arms  # same seed
    assert anonymous_arms(Router(BOTH, {"diffusion", "ar"}, seed=4)) != arms  # other seed


def test_override_wins_and_is_labelled():
    router = Router({"diffusion": 1.0}, {"diffusion", "ar"})
    assignment = router.assign("user-1", "ar")
    assert assignment.route == "ar" and assignment.arm == OVERRIDE_ARM
    assert router.assign("user-1", "auto").route == "diffusion"
    assert router.assign(None, "single").route == "single"


def test_unloaded_arms_are_dropped():
    router = Router({"diffusion": 0.9, "ar": 0.1}, {"ar", "single"})
    assert router.weights == {"ar": 1.0}
    assert {router.assign(f"u{i}").route for i in range(50)} == {"ar"}


@pytest.mark.parametrize("weights, available, best", [
    ({}, {"diffusion", "ar", "single"}, "diffusion"),
    ({"diffusion": 1.0}, {"ar", "single"}, "ar"),
    ({"diffusion": 1.0}, {"hybrid", "single"}, "hybrid"),
    (BOTH, {"single"}, "single"),
])
def test_without_a_loaded_arm_everything_goes_to_the_best_loaded_route(weights, available,
                                                                         best):
    assert ROUTE_ORDER == ("diffusion", "ranked", "ar", "hybrid", "single")
    router = Router(weights, available, seed=0)
    assert router.weights == {best: 1.0}
    users = [router.assign(f"u{i}") for i in range(50)]
    anonymous = [router.assign(None) for _ in range(50)]
    assert {(a.route, a.arm) for a in users + anonymous} == {(best, best)}
