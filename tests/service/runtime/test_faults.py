"""Injected faults: a stall sleeps only once armed (warm-up passes), at its rate."""

from __future__ import annotations

import pytest

from service.runtime import faults
from service.runtime.faults import Stall


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    calls: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", calls.append)
    return calls


def test_a_stall_waits_for_warm_up_then_stalls_at_its_rate(slept: list[float]):
    always, never = Stall(1.0, 2.5, seed=0), Stall(0.0, 2.5, seed=0)
    always(), never()
    assert slept == []  # not armed: warm-up runs unstalled
    always.armed = never.armed = True
    for _ in range(3):
        always(), never()
    assert slept == [2.5] * 3


def test_a_share_of_batches_stalls(slept: list[float]):
    stall = Stall(0.25, 1.0, seed=7)
    stall.armed = True
    for _ in range(2000):
        stall()
    assert 400 <= len(slept) <= 600  # binomial(2000, 0.25): outside is < 1e-13
