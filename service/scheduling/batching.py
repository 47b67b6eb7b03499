"""Dynamic batching: one batcher per retrieval path, owning a bounded asyncio queue.

A batch is what is queued when the worker frees, so batches grow with the load and a lone
request never waits (as in TEI); requests cancelled or past their deadline are dropped before
compute, which runs in the batcher's thread off the event loop. A batch failing on a request's
data (REQUEST_ERRORS) is recomputed request by request, so a bad request fails only itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from service.errors import DeadlineError, InputError, OverloadError, UnavailableError
from service.metrics import Metrics

log = logging.getLogger("r4t.batching")
P = TypeVar("P")
R = TypeVar("R")
EWMA_ALPHA = 0.2  # weight of the newest batch in the compute-time estimate
CLOSE_GRACE_S = 10.0
STALL_FACTOR = 2.0  # a batch this many times slower than expected counts as stalled
# errors a request's own data can cause; any other (an engine's: ONNX Runtime, FAISS, an
# endpoint) is the route's, and computing each request alone would only repeat it
REQUEST_ERRORS = (InputError, LookupError, TypeError, ValueError)


@dataclass
class Job(Generic[P]):
    payload: P
    future: asyncio.Future
    deadline: float  # time.monotonic() by which the answer is due
    enqueued: float  # time.monotonic() at submission


@dataclass
class Completed(Generic[R]):
    result: R
    queue_s: float  # time spent waiting before its batch started
    batch_size: int


class Batcher(Generic[P, R]):
    """Collects submissions into batches for `compute(payloads) -> results` (same order)."""

    def __init__(
        self,
        name: str,
        compute: Callable[[Sequence[P]], Sequence[R]],
        *,
        max_batch_size: int,
        max_wait_ms: float,
        queue_size: int,
        admit_wait_fraction: float = 1.0,
        nice: int = 0,
        metrics: Metrics | None = None,
    ) -> None:
        self.name = name
        self._compute = compute
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.admit_wait_fraction = admit_wait_fraction
        self._queue: asyncio.Queue[Job[P]] = asyncio.Queue(maxsize=queue_size)
        self._arrived = asyncio.Event()
        self._metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"r4t-{name}",
                                            initializer=yield_to_the_loop, initargs=(nice,))
        self._task: asyncio.Task | None = None
        self._busy = False
        self._computing_since: float | None = None  # time.monotonic() the batch started
        self._computing_s = 0.0  # how long that batch is expected to take
        self._current: list[Job[P]] = []  # the batch being collected or computed
        self._closed = False
        self.batch_s_estimate = 0.0  # EWMA of a batch's compute time
        self.item_s_estimate = 0.0  # EWMA of a batch's compute time per request in it

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name=f"batcher-{self.name}")

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def forget_estimates(self) -> None:
        """Start the compute-time estimates afresh from the next batch (after a warm-up's
        first run, whose one-time set-up would otherwise inflate them for many batches)."""
        self.batch_s_estimate = self.item_s_estimate = 0.0

    @property
    def busy(self) -> bool:
        """A batch is in compute or requests are queued."""
        return self._computing_since is not None or not self._queue.empty()

    def expected_wait_s(self) -> float:
        """Time a request submitted now waits before its batch starts: the rest of the batch in
        compute plus the queue ahead at the measured time per request (EWMAs; per request, as AR
        batches cost in proportion to their size), plus `max_wait_ms`. A batch past STALL_FACTOR
        times its expected time counts as running on as long again as it has overrun, so a stall
        reads as a growing wait (admission refuses) and a merely slow batch does not.
        """
        queued = self._queue.qsize() * self.item_s_estimate
        computing = 0.0
        if self._computing_since is not None:  # what is left of the batch in compute
            elapsed, expected = time.monotonic() - self._computing_since, self._computing_s
            computing = max(expected - elapsed, 0.0) + max(elapsed - STALL_FACTOR * expected,
                                                           0.0)
        return queued + computing + self.max_wait_s

    def admit(self, deadline: float) -> None:
        """Refuse (OverloadError) a request that would wait longer than its share of the time
        it has left, or, behind other work, whose wait and its own compute (the measured
        compute per request) outlast that time: refused now it costs a fast 429, admitted it
        would time out as a 504. An idle path admits, so its estimates can always recover."""
        expected, left = self.expected_wait_s(), deadline - time.monotonic()
        budget, busy = left * self.admit_wait_fraction, self.busy
        if expected > budget or (busy and expected + self.item_s_estimate > left):
            raise OverloadError(
                f"the {self.name} route is busy: expected wait {expected * 1000:.0f} ms (budget "
                f"{max(budget, 0.0) * 1000:.0f} ms), then {self.item_s_estimate * 1000:.0f} ms "
                f"of compute, against {max(left, 0.0) * 1000:.0f} ms left; retry shortly",
                retry_after_s=expected,
            )

    async def submit(self, payload: P, deadline: float) -> Completed[R]:
        """Queue one request and wait for its answer; OverloadError when the queue is full or
        the expected wait exceeds the request's budget."""
        if self._closed:
            raise UnavailableError(f"the {self.name} route is shutting down")
        self.admit(deadline)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        job = Job(payload, future, deadline, time.monotonic())
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            raise OverloadError(
                f"the {self.name} queue is full ({self._queue.maxsize} waiting); retry shortly",
                retry_after_s=self.expected_wait_s(),
            ) from None
        self._arrived.set()
        self._set_depth()
        remaining = deadline - time.monotonic()
        try:
            return await asyncio.wait_for(future, timeout=max(remaining, 0.0))
        except TimeoutError:  # wait_for cancelled the future: the batcher will skip it
            raise DeadlineError(
                f"no answer from the {self.name} path before the request deadline"
            ) from None

    async def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Stop taking requests, let queued ones finish within `grace_s`, then stop the worker;
        what is left is answered with UnavailableError (a 503)."""
        self._closed = True
        stop_at = time.monotonic() + grace_s
        while (self._queue.qsize() or self._busy) and time.monotonic() < stop_at:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        leftover = list(self._current)
        while not self._queue.empty():
            leftover.append(self._queue.get_nowait())
        self._fail(leftover, UnavailableError(f"the {self.name} path was closed"))
        self._set_depth()
        self._executor.shutdown(wait=False)

    @staticmethod
    def _fail(jobs: list[Job[P]], error: Exception) -> None:
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(error)

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            self._busy, self._current = True, batch  # busy from the first take: close waits
            try:
                await self._fill(batch)
                self._set_depth()
                live = self._live(batch)
                if live:
                    await self._compute_batch(live)
            except asyncio.CancelledError:  # closed mid-batch: answer every caller now
                self._fail(batch, UnavailableError(f"the {self.name} path was closed"))
                raise
            finally:
                self._busy, self._current = False, []

    async def _fill(self, batch: list[Job[P]]) -> None:
        """Add queued jobs until the batch is full or max_wait has passed since the first."""
        close_at = batch[0].enqueued + self.max_wait_s
        while len(batch) < self.max_batch_size:
            self._arrived.clear()
            while len(batch) < self.max_batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            remaining = close_at - time.monotonic()
            if len(batch) >= self.max_batch_size or remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), timeout=remaining)

    def _live(self, batch: list[Job[P]]) -> list[Job[P]]:
        """Drop jobs whose caller went away or whose deadline passed."""
        now = time.monotonic()
        live = []
        for job in batch:
            if job.future.done():
                self._count_skip("cancelled")
            elif now >= job.deadline:
                job.future.set_exception(
                    DeadlineError(f"the request deadline passed in the {self.name} queue")
                )
                self._count_skip("deadline")
            else:
                live.append(job)
        return live

    async def _compute_batch(self, jobs: list[Job[P]]) -> None:
        try:
            results, started = await self._timed_compute(jobs)
        except Exception as exc:
            if len(jobs) == 1 or not isinstance(exc, REQUEST_ERRORS):
                self._fail(jobs, exc)  # the route failed: every caller gets the error
                return
            log.warning("a batch of %d failed (%s: %s); computing each request alone, so that "
                        "one bad request fails only itself", len(jobs), type(exc).__name__, exc)
            for job in jobs:
                if self._live([job]):
                    await self._compute_batch([job])
            return
        if self._metrics is not None:
            self._metrics.batch_size.labels(route=self.name).observe(len(jobs))
        for job, result in zip(jobs, results, strict=True):
            if not job.future.done():
                job.future.set_result(Completed(result, started - job.enqueued, len(jobs)))

    async def _timed_compute(self, jobs: list[Job[P]]) -> tuple[Sequence[R], float]:
        """The batch's results and when its compute started; the estimates learn its time."""
        self._computing_s = max(self.batch_s_estimate, self.item_s_estimate * len(jobs))
        started = self._computing_since = time.monotonic()
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._compute, [job.payload for job in jobs])
        finally:
            self._computing_since = None
        elapsed = time.monotonic() - started  # a failed batch's time is not compute time
        self.batch_s_estimate = ewma(self.batch_s_estimate, elapsed)
        self.item_s_estimate = ewma(self.item_s_estimate, elapsed / len(jobs))
        return results, started

    def _set_depth(self) -> None:
        if self._metrics is not None:
            self._metrics.queue_depth.labels(route=self.name).set(self._queue.qsize())

    def _count_skip(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.skipped.labels(route=self.name, reason=reason).inc()


def yield_to_the_loop(nice: int) -> None:
    """Lower the calling thread's scheduling priority by `nice` (Linux: per thread; threads it
    starts, such as OpenMP's and ONNX Runtime's pools, inherit it), so that the event loop,
    which admits, refuses and answers, is scheduled first when the cores are busy computing."""
    if nice <= 0:
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread,
                       min(os.getpriority(os.PRIO_PROCESS, thread) + nice, 19))
    except OSError as exc:  # a platform without per-thread priorities: run as it is
        log.warning("could not lower the priority of a compute thread: %s", exc)


def ewma(estimate: float, value: float) -> float:
    """The next estimate; the first value is taken as it is."""
    return value if estimate == 0.0 else estimate + EWMA_ALPHA * (value - estimate)


def describe(batcher: Batcher[Any, Any]) -> dict[str, Any]:
    return {
        "max_batch_size": batcher.max_batch_size,
        "max_wait_ms": batcher.max_wait_s * 1000.0,
        "queue_depth": batcher.depth,
        "batch_ms_estimate": round(batcher.batch_s_estimate * 1000.0, 3),
        "request_ms_estimate": round(batcher.item_s_estimate * 1000.0, 3),
        "expected_wait_ms": round(batcher.expected_wait_s() * 1000.0, 3),
    }
