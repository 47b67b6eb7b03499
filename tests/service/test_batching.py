"""The batcher on its own, with a plain compute function that records what it was given."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from service.batching import Batcher
from service.errors import DeadlineError, OverloadError, UnavailableError
from service.metrics import Metrics


class Recorder:
    """compute(payloads) → payloads doubled; remembers each batch and the thread it ran on."""

    def __init__(self, pause_s: float = 0.0, fail: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.threads: set[int] = set()
        self.pause_s, self.fail = pause_s, fail

    def __call__(self, payloads: Sequence[int]) -> list[int]:
        self.batches.append(list(payloads))
        self.threads.add(threading.get_ident())
        time.sleep(self.pause_s)
        if self.fail:
            raise RuntimeError("model exploded")
        return [2 * p for p in payloads]


def run(coro):
    return asyncio.run(coro)


def make(recorder: Recorder, **kwargs) -> Batcher[int, int]:
    options = {"max_batch_size": 4, "max_wait_ms": 50.0, "queue_size": 64, "metrics": Metrics()}
    return Batcher("test", recorder, **{**options, **kwargs})


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
    assert answer.queue_s >= 0.019


def test_full_queue_raises_overload_immediately():
    recorder = Recorder(pause_s=0.2)

    async def scenario():
        batcher = make(recorder, max_batch_size=1, queue_size=2, max_wait_ms=0.0)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(0, far()))
        await asyncio.sleep(0.05)  # 0 is computing; the queue is empty again
        queued = [asyncio.ensure_future(batcher.submit(i, far())) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(OverloadError):
            await batcher.submit(3, far())
        results = await asyncio.gather(first, *queued)
        await batcher.close()
        return [r.result for r in results]

    assert run(scenario()) == [0, 2, 4]
    assert 3 not in [p for b in recorder.batches for p in b]


def test_cancelled_and_expired_requests_are_skipped_before_compute():
    recorder = Recorder(pause_s=0.2)

    async def scenario():
        batcher = make(recorder, max_batch_size=1, max_wait_ms=0.0)
        batcher.start()
        busy = asyncio.ensure_future(batcher.submit(0, far()))
        await asyncio.sleep(0.05)
        gone = asyncio.ensure_future(batcher.submit(1, far()))
        late = asyncio.ensure_future(batcher.submit(2, time.monotonic() + 0.1))
        kept = asyncio.ensure_future(batcher.submit(3, far()))
        await asyncio.sleep(0.01)
        gone.cancel()  # the caller went away
        with pytest.raises(DeadlineError):
            await late
        results = await asyncio.gather(busy, kept)
        await batcher.close()
        return [r.result for r in results]

    assert run(scenario()) == [0, 6]
    assert recorder.batches == [[0], [3]]


def test_compute_errors_reach_every_caller_of_the_batch():
    async def scenario():
        batcher = make(Recorder(fail=True))
        batcher.start()
        outcomes = await asyncio.gather(*(batcher.submit(i, far()) for i in range(3)),
                                        return_exceptions=True)
        await batcher.close()
        return outcomes

    outcomes = run(scenario())
    assert all(isinstance(o, RuntimeError) for o in outcomes)


def test_closed_batcher_refuses_new_work_and_finishes_queued_work():
    recorder = Recorder(pause_s=0.05)

    async def scenario():
        batcher = make(recorder, max_batch_size=1, max_wait_ms=0.0)
        batcher.start()
        pending = [asyncio.ensure_future(batcher.submit(i, far())) for i in range(3)]
        await asyncio.sleep(0)
        await batcher.close()
        with pytest.raises(UnavailableError):
            await batcher.submit(9, far())
        return [p.result().result for p in pending]

    assert run(scenario()) == [0, 2, 4]


def test_close_answers_the_batch_in_compute_at_once(monkeypatch):
    """A batch still computing when the grace period ends is failed, not left to its deadline."""
    monkeypatch.setattr("service.batching.CLOSE_GRACE_S", 0.2)
    recorder = Recorder(pause_s=2.0)

    async def scenario():
        batcher = make(recorder, max_wait_ms=0.0)
        batcher.start()
        pending = asyncio.ensure_future(batcher.submit(1, time.monotonic() + 20.0))
        await asyncio.sleep(0.1)  # the job is now inside compute
        began = time.monotonic()
        await batcher.close()
        with pytest.raises(UnavailableError):
            await pending
        return time.monotonic() - began

    assert run(scenario()) < 5.0  # well before the 20 s deadline
