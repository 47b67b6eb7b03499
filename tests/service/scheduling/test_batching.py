"""The batcher on its own, with a plain compute function that records what it was given.

Tests that need work to be queued behind a batch in compute hold that batch with an event
(`Recorder(gated=True)`, released by the test) and wait for the queue depth they need with a
bounded deadline, so their order never depends on how fast the machine is."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Sequence

import pytest

from service.errors import DeadlineError, OverloadError, UnavailableError
from service.metrics import Metrics
from service.scheduling.batching import Batcher

WAIT_S = 10.0  # bound on every wait below; reached only when something is broken


class Recorder:
    """compute(payloads) → payloads doubled; remembers each batch and the thread it ran on.

    gated=True: every batch, once inside compute (`entered` is set), waits for `release`.
    """

    def __init__(self, fail: bool = False, gated: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.threads: set[int] = set()
        self.fail = fail
        self.entered = threading.Event()
        self.release = threading.Event()
        if not gated:
            self.release.set()

    def __call__(self, payloads: Sequence[int]) -> list[int]:
        self.batches.append(list(payloads))
        self.threads.add(threading.get_ident())
        self.entered.set()
        if not self.release.wait(WAIT_S):
            raise TimeoutError("the test never released the compute")
        if self.fail:
            raise RuntimeError("model exploded")
        return [2 * p for p in payloads]


async def wait_for(event: threading.Event) -> None:
    """Wait (off the event loop) for an event set in the batcher's worker thread."""
    assert await asyncio.to_thread(event.wait, WAIT_S), f"event not set within {WAIT_S} s"


async def wait_until(predicate: Callable[[], bool]) -> None:
    """Poll a condition that has no event of its own (e.g. the queue depth), bounded."""
    stop = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < stop, f"condition not met within {WAIT_S} s"
        await asyncio.sleep(0.001)


def run(coro):
    return asyncio.run(coro)


def make(recorder: Recorder, **kwargs) -> Batcher[int, int]:
    options = {"max_batch_size": 4, "max_wait_ms": 50.0, "queue_size": 64, "metrics": Metrics()}
    return Batcher("test", recorder, **{**options, **kwargs})


def skipped(batcher: Batcher, reason: str) -> float:
    value = batcher._metrics.registry.get_sample_value(
        "r4t_skipped_requests_total", {"route": "test", "reason": reason})
    return value or 0.0


def far() -> float:
    return time.monotonic() + 30.0


def test_batches_close_at_max_size_and_answers_keep_their_order():
    recorder = Recorder()

    async def scenario():
        batcher = make(recorder)
        batcher.start()
        done = await asyncio.gather(*(batcher.submit(i, far()) for i in range(10)))
        await batcher.close()
        return done

    done = run(scenario())
    assert [c.result for c in done] == [2 * i for i in range(10)]
    assert [len(b) for b in recorder.batches] == [4, 4, 2]
    assert sorted(p for b in recorder.batches for p in b) == list(range(10))
    assert [c.batch_size for c in done] == [4] * 8 + [2] * 2
    assert threading.get_ident() not in recorder.threads  # computed off the event loop


def test_a_lone_request_is_served_after_max_wait():
    recorder = Recorder()

    async def scenario():
        batcher = make(recorder, max_batch_size=100, max_wait_ms=20.0)
        batcher.start()
        answer = await batcher.submit(7, far())
        await batcher.close()
        return answer

    answer = run(scenario())
    assert answer.result == 14 and answer.batch_size == 1
    assert answer.queue_s >= 0.019  # a lower bound: the batch waited out its window


def test_without_a_wait_the_batch_is_what_queued_while_the_worker_computed():
    recorder = Recorder(gated=True)

    async def scenario():
        batcher = make(recorder, max_batch_size=8, max_wait_ms=0.0)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(0, far()))
        await wait_for(recorder.entered)  # the lone first request went at once, alone
        rest = [asyncio.ensure_future(batcher.submit(i, far())) for i in range(1, 6)]
        await wait_until(lambda: batcher.depth == 5)
        recorder.release.set()
        done = await asyncio.gather(first, *rest)
        await batcher.close()
        return done

    done = run(scenario())
    assert recorder.batches == [[0], [1, 2, 3, 4, 5]]  # the queue, taken whole when it freed
    assert [c.batch_size for c in done] == [1] + [5] * 5


def test_full_queue_raises_overload_immediately():
    recorder = Recorder(gated=True)

    async def scenario():
        batcher = make(recorder, max_batch_size=1, queue_size=2, max_wait_ms=0.0)
        batcher.start()
        try:
            first = asyncio.ensure_future(batcher.submit(0, far()))
            await wait_for(recorder.entered)  # 0 is computing; the queue is empty again
            assert batcher.depth == 0
            queued = [asyncio.ensure_future(batcher.submit(i, far())) for i in (1, 2)]
            await wait_until(lambda: batcher.depth == 2)
            with pytest.raises(OverloadError, match="queue is full"):
                await batcher.submit(3, far())
            assert batcher.depth == 2 and not first.done()  # refused while 0 is still held
        finally:
            recorder.release.set()
        results = await asyncio.gather(first, *queued)
        await batcher.close()
        return [r.result for r in results]

    assert run(scenario()) == [0, 2, 4]
    assert recorder.batches == [[0], [1], [2]]


def test_cancelled_and_expired_requests_are_skipped_before_compute():
    recorder = Recorder(gated=True)

    async def scenario():
        batcher = make(recorder, max_batch_size=1, max_wait_ms=0.0)
        batcher.start()
        try:
            busy = asyncio.ensure_future(batcher.submit(0, far()))
            await wait_for(recorder.entered)
            gone = asyncio.ensure_future(batcher.submit(1, far()))
            late = asyncio.ensure_future(batcher.submit(2, time.monotonic() + 0.1))
            kept = asyncio.ensure_future(batcher.submit(3, far()))
            await wait_until(lambda: batcher.depth == 3)
            gone.cancel()  # the caller went away
            with pytest.raises(asyncio.CancelledError):
                await gone
            with pytest.raises(DeadlineError):  # its deadline passes while 0 is held
                await late
            assert batcher.depth == 3 and not busy.done()
        finally:
            recorder.release.set()
        results = await asyncio.gather(busy, kept)
        await batcher.close()
        return [r.result for r in results], batcher

    results, batcher = run(scenario())
    assert results == [0, 6]
    assert recorder.batches == [[0], [3]]
    assert skipped(batcher, "cancelled") + skipped(batcher, "deadline") == 2


def test_an_engine_error_reaches_every_caller_of_the_batch_once():
    recorder = Recorder(fail=True)

    async def scenario():
        batcher = make(recorder)
        batcher.start()
        outcomes = await asyncio.gather(*(batcher.submit(i, far()) for i in range(3)),
                                        return_exceptions=True)
        await batcher.close()
        return outcomes

    outcomes = run(scenario())
    assert len(outcomes) == 3
    assert all(isinstance(o, RuntimeError) and str(o) == "model exploded" for o in outcomes)
    assert len(recorder.batches) == 1  # an engine's error: not tried request by request


class Picky(Recorder):
    """Fails any batch holding a negative payload with a ValueError (a request's data)."""

    def __call__(self, payloads: Sequence[int]) -> list[int]:
        if any(p < 0 for p in payloads):
            self.batches.append(list(payloads))
            raise ValueError("cannot serve a negative")
        return super().__call__(payloads)


def test_one_bad_request_fails_only_itself():
    recorder = Picky()

    async def scenario():
        batcher = make(recorder, max_wait_ms=200.0)
        batcher.start()
        try:
            return await asyncio.gather(*(batcher.submit(p, far()) for p in (1, -1, 2)),
                                        return_exceptions=True)
        finally:
            await batcher.close()

    good, bad, other = run(scenario())
    assert (good.result, other.result) == (2, 4)
    assert isinstance(bad, ValueError)
    assert recorder.batches[0] == [1, -1, 2]  # one batch failed, then each alone
    assert sorted(map(tuple, recorder.batches[1:])) == [(-1,), (1,), (2,)]


def test_closed_batcher_refuses_new_work_and_finishes_queued_work():
    recorder = Recorder(gated=True)

    async def scenario():
        batcher = make(recorder, max_batch_size=1, max_wait_ms=0.0)
        batcher.start()
        try:
            pending = [asyncio.ensure_future(batcher.submit(i, far())) for i in range(3)]
            await wait_for(recorder.entered)
            await wait_until(lambda: batcher.depth == 2)  # 0 held, 1 and 2 queued
            closing = asyncio.ensure_future(batcher.close())
            await asyncio.sleep(0)  # one loop turn, not a wait: close() marks it closed first
            with pytest.raises(UnavailableError, match="shutting down"):
                await batcher.submit(9, far())
            assert not closing.done() and batcher.depth == 2  # the queued work is kept
        finally:
            recorder.release.set()
        await closing
        return [p.result().result for p in pending]

    assert run(scenario()) == [0, 2, 4]
    assert recorder.batches == [[0], [1], [2]]


def test_close_answers_the_batch_in_compute_at_once():
    """A batch still computing when the grace period ends is failed, not left to its deadline:
    close returns, its caller answered 503, while compute is still held."""
    recorder = Recorder(gated=True)  # never released before close: compute outlives the grace

    async def scenario() -> bool:
        batcher = make(recorder, max_wait_ms=0.0)
        batcher.start()
        try:
            pending = asyncio.ensure_future(batcher.submit(1, time.monotonic() + 20.0))
            await wait_for(recorder.entered)  # the job is now inside compute
            await batcher.close(0.2)
            with pytest.raises(UnavailableError, match="closed"):
                await pending
            return recorder.release.is_set()
        finally:
            recorder.release.set()  # let the worker thread finish

    assert run(scenario()) is False  # answered while compute was still held


class Working:
    """compute that takes `work_s` per batch (a model's time), announcing when it starts."""

    def __init__(self, work_s: float) -> None:
        self.work_s = work_s
        self.entered = threading.Event()

    def __call__(self, payloads: Sequence[int]) -> list[int]:
        self.entered.set()
        time.sleep(self.work_s)  # the work itself; no step of the test is ordered by it
        return [2 * p for p in payloads]


async def computing(work: Working, fraction: float, deadline_s: float
                    ) -> tuple[Batcher[int, int], asyncio.Future]:
    """A started batcher that has measured `work`'s time, with request 2 now in compute."""
    batcher = Batcher("t", work, max_batch_size=1, max_wait_ms=0, queue_size=16,
                      admit_wait_fraction=fraction)
    batcher.start()
    await batcher.submit(1, time.monotonic() + deadline_s)  # measures the batch time
    work.entered.clear()
    ahead = asyncio.ensure_future(batcher.submit(2, time.monotonic() + deadline_s))  # idle
    await wait_for(work.entered)
    return batcher, ahead


def test_admission_refuses_what_would_wait_past_its_budget():
    work = Working(2.0)

    async def scenario():
        # budget = a fifth of the time left (0.8 s): an idle path admits; waiting for what is
        # left of a batch in compute (up to 2 s) does not fit, checked within 1.2 s of its start
        batcher, first = await computing(work, 0.2, 4.0)
        try:
            assert batcher.batch_s_estimate >= work.work_s
            with pytest.raises(OverloadError) as refused:  # behind the batch in compute
                await batcher.submit(3, time.monotonic() + 4.0)
            assert refused.value.retry_after_s > 0.8
            assert "expected wait" in str(refused.value)
            assert (await first).result == 4
            assert batcher.depth == 0  # the refused request never took a queue slot
            assert batcher.expected_wait_s() == 0.0  # idle again
        finally:
            await batcher.close()

    run(scenario())


def test_compute_threads_yield_to_the_event_loop():
    def priority(payloads: Sequence[int]) -> list[int]:
        return [os.getpriority(os.PRIO_PROCESS, 0) for _ in payloads]  # Linux: this thread's

    async def scenario():
        batcher = Batcher("t", priority, max_batch_size=1, max_wait_ms=0, queue_size=4, nice=3)
        batcher.start()
        try:
            return (await batcher.submit(0, far())).result
        finally:
            await batcher.close()

    loop_priority = os.getpriority(os.PRIO_PROCESS, 0)
    assert run(scenario()) == min(loop_priority + 3, 19)
    assert os.getpriority(os.PRIO_PROCESS, 0) == loop_priority  # the caller's is untouched


def test_a_batch_stalled_past_its_estimate_stops_admission():
    """A batch that overruns its measured time counts as running on for as long as it has
    overrun, so a stall shows as a growing wait and new requests get a fast 429 instead of
    queueing to a 504 (issue 41, item 2)."""
    recorder = Recorder(gated=True)

    async def scenario():
        batcher = make(recorder, max_batch_size=1, max_wait_ms=0.0, admit_wait_fraction=0.2)
        batcher.start()
        try:
            recorder.release.set()
            assert (await batcher.submit(1, far())).result == 2  # measures a fast batch
            estimate = batcher.batch_s_estimate
            recorder.release.clear()
            recorder.entered.clear()
            stalled = asyncio.ensure_future(batcher.submit(2, far()))
            await wait_for(recorder.entered)  # in compute, and it will not finish
            await wait_until(lambda: batcher.expected_wait_s() > 0.2 + estimate)
            with pytest.raises(OverloadError):  # budget: a fifth of 1 s
                await batcher.submit(3, time.monotonic() + 1.0)
            assert batcher.depth == 0
            recorder.release.set()
            assert (await stalled).result == 4
        finally:
            recorder.release.set()
            await batcher.close()

    run(scenario())


def test_admission_counts_the_requests_own_compute_behind_other_work():
    """Behind a batch in compute, a request whose wait and its own compute outlast its
    deadline is refused at once (429) instead of computing an answer nobody waits for (issue
    41, item 2); an idle path admits it (its estimates can only recover by computing)."""
    work = Working(1.5)

    async def scenario():
        batcher, ahead = await computing(work, 1.0, 10.0)  # 1.5 s per request measured
        try:
            with pytest.raises(OverloadError) as refused:  # ~1.5 s of wait, then 1.5 s
                await batcher.submit(3, time.monotonic() + 2.5)
            assert "of compute" in str(refused.value)
            assert (await ahead).result == 4
        finally:
            await batcher.close()

    run(scenario())
