"""The admission gate's measure: the concurrency the service has been answering."""

from __future__ import annotations

from service.api.middleware import AdmissionGate, ServedConcurrency


async def never_called(scope, receive, send) -> None:
    raise AssertionError("the gate was only asked for its limit")


def test_served_concurrency_is_the_time_answers_held_over_the_window():
    served = ServedConcurrency(window_s=2.0)
    for end in (10.0, 10.5, 11.0, 11.5):  # four answers of 0.5 s each in 2 s: one at a time
        served.record(end, 0.5)
    assert served.value(11.5) == 1.0
    served.record(11.6, 3.0)  # one slow answer held 3 s
    assert served.value(11.6) == 2.5
    assert served.value(12.6) == 2.0  # 10.0 and 10.5 left the window
    assert served.value(100.0) == 0.0


def test_gate_limit_follows_what_is_answered_never_below_its_floor():
    gate = AdmissionGate(never_called, max_in_flight=512, retry_after_s=1, prefix="/v1",
                         on_reject=lambda: None, headroom=1.5, floor=8)
    assert gate.limit(0.0) == 512  # nothing answered yet: only the hard cap
    for i in range(40):  # 40 answers of 1 s within the 2 s window: 20 at once
        gate.served.record(1.0 + i * 0.025, 1.0)
    assert gate.limit(2.0) == 30  # 1.5 x 20
    gate.served.record(2.5, 0.01)
    assert gate.limit(4.0) == 8  # the window holds one quick answer: the floor
    unlimited = AdmissionGate(never_called, max_in_flight=64, retry_after_s=1, prefix="/v1",
                              on_reject=lambda: None)
    unlimited.served.record(1.0, 100.0)
    assert unlimited.limit(1.0) == 64  # without headroom: the hard cap only
