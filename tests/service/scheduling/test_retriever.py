"""The served state's life cycle: a retired retriever is freed by reference counting (no cycle
left for a full collection to find), and closing one never stops the event loop."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from pathlib import Path

import pytest

from service.errors import BundleError
from service.metrics import Metrics
from service.routes.answer import RouteQuery
from service.scheduling.assembly import Loaders
from service.scheduling.retriever import Retriever
from service.settings import Settings

HOLD_S = 30.0  # bound on the simulated decode; reached only when the loop is stopped


async def loaded(settings: Settings) -> Retriever:
    retriever = Retriever.load(settings, Metrics(), settings.bundle, Loaders())
    retriever.start()
    await retriever.warm_up(strict=True)
    return retriever


def test_a_closed_retriever_is_freed_without_the_cyclic_collector(settings_for):
    """The service freezes the served bundle out of the collector's reach (a full collection
    stops the loop); a cycle through a retired bundle would then hold its memory for good.
    With the collector off, nothing of a closed retriever may be left for it to find."""

    async def retire() -> list[weakref.ref]:
        retriever = await loaded(settings_for(warmup_queries=2))
        assert {"ranked", "ar", "single"} <= set(retriever.paths)
        bundle = retriever.bundle
        held = [retriever, bundle, bundle.index, bundle.lexical, bundle.lexical.tokenizer]
        await retriever.close()
        return [weakref.ref(thing) for thing in held]

    gc.collect()
    gc.disable()
    try:
        refs = asyncio.run(retire())
        alive = {id(thing) for ref in refs if (thing := ref()) is not None}
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds unreachable is kept here
        gc.collect()
        cyclic = [type(thing).__name__ for thing in gc.garbage if id(thing) in alive]
        assert cyclic == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_closing_a_llama_policy_mid_decode_leaves_the_loop_running(llm_bundle: Path):
    """llama.cpp's close waits for the decode in progress; the retriever waits for it in a
    thread, so the loop goes on (here: it sees close waiting and ends the decode)."""
    ticked, closing = threading.Event(), threading.Event()

    async def close_while_decoding() -> bool:
        retriever = await loaded(Settings(bundle=llm_bundle, threads=1, warmup_queries=1,
                                          index="bundle"))
        backend = retriever.paths["ar"].backend
        close, held = backend.close, threading.Event()

        def decode() -> bool:  # what a long llama batch does: hold the backend's lock
            with backend._lock:
                held.set()
                return ticked.wait(HOLD_S)  # ended by the loop, if it runs

        def close_and_say() -> None:
            closing.set()
            close()  # waits for the lock

        backend.close = close_and_say
        decoding = asyncio.get_running_loop().run_in_executor(None, decode)
        await asyncio.to_thread(held.wait, HOLD_S)
        task = asyncio.create_task(retriever.close())
        await asyncio.to_thread(closing.wait, HOLD_S)  # close is waiting on the lock
        ticked.set()  # and the loop still ran
        await task
        return await decoding

    assert asyncio.run(close_while_decoding())


def test_route_auto_scores_a_querys_breadth_off_the_event_loop(settings_for):
    """Scoring a query's breadth may cost SQLite statements (never-seen words): never on the
    loop's thread."""

    async def ask() -> list[bool]:
        retriever = await loaded(settings_for(warmup_queries=1, routes="ranked=1"))
        decide, on_loop = retriever.trigger.decide, []

        def spy(*args: object) -> object:
            on_loop.append(threading.current_thread() is loop_thread)
            return decide(*args)

        retriever.trigger.decide = spy  # type: ignore[method-assign]
        loop_thread = threading.current_thread()
        try:
            await retriever.retrieve(RouteQuery("zqxv " * 200 + "dog", 10), time.monotonic() + 60)
        finally:
            await retriever.close()
        return on_loop

    assert asyncio.run(ask()) == [False]


def test_a_path_that_fails_every_replayed_query_refuses_the_reload(settings_for):
    """What the old bundle answered, the new one must answer some of: a path failing all of
    it is a BundleError (the reload is refused), not a swap."""

    async def replay() -> None:
        retriever = await loaded(settings_for(warmup_queries=1, routes="ranked=1"))

        async def failing(*_: object) -> None:
            raise RuntimeError("this path cannot answer")

        retriever.batchers["single"].submit = failing  # type: ignore[method-assign]
        try:
            await retriever._replay(["dog", "cat"])
        finally:
            await retriever.close()

    with pytest.raises(BundleError, match="single path failed every one of the 2"):
        asyncio.run(replay())


def test_a_retriever_closes_its_routes_together_within_one_grace(settings_for, monkeypatch):
    """Shutdown's grace is shared, not spent per route: every batcher starts closing before
    any has finished."""
    from service.scheduling.batching import Batcher

    events: list[str] = []
    close = Batcher.close

    async def recorded(self, grace_s: float = 10.0) -> None:
        events.append(f"start {self.name}")
        await close(self, grace_s)
        events.append(f"end {self.name}")

    monkeypatch.setattr(Batcher, "close", recorded)

    async def closed() -> int:
        retriever = await loaded(settings_for(warmup_queries=1, routes="ranked=1"))
        routes = len(retriever.batchers)
        await retriever.close(0.5)
        await retriever.close(0.5)  # twice: nothing more
        return routes

    routes = asyncio.run(closed())
    assert routes >= 3 and len(events) == 2 * routes
    assert all(e.startswith("start") for e in events[:routes])
