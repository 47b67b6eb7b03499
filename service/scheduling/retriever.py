"""A loaded bundle ready to serve: its paths (assembly.py), batchers and router, swapped whole
on reload by the served state (service/api/state.py). A request goes to its A/B arm (trigger.py
for route=auto); a failing or ungrounded answer falls back along its route's chain (FALLBACKS),
each counted by reason; a route too busy to answer in time refuses (429)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from service.artifacts.bundle import Bundle, load_bundle
from service.artifacts.stages import recorded_routes
from service.errors import (
    BundleError,
    DeadlineError,
    IndexUnavailableError,
    OverloadError,
    R4TError,
    UnavailableError,
)
from service.metrics import Metrics
from service.routes import FALLBACKS, LAST_ROUTE, ROUTE_ORDER
from service.routes.answer import RouteAnswer, RouteQuery
from service.routes.route import Route
from service.runtime.encoder import Encoder
from service.runtime.faults import Stall
from service.runtime.filters import metadata_fields, where_of
from service.runtime.index import IndexChoice, set_threads
from service.scheduling.assembly import Loaders, load_routes
from service.scheduling.batching import CLOSE_GRACE_S, Batcher, Completed, describe
from service.scheduling.routing import Assignment, Router
from service.scheduling.trigger import Decision, FanoutMode, FanoutTrigger
from service.settings import Settings

log = logging.getLogger("r4t.retriever")

WARMUP_QUERIES = ("camping gear", "kitchen utensils", "musical instrument", "vehicle", "tree")
WARMUP_DEADLINE_S = 120.0
RECENT_QUERIES = 64  # the last queries answered, replayed through a reloaded bundle's paths


@dataclass
class Served:
    """One answered request: the path's answer and how it was reached."""

    answer: RouteAnswer
    route: str  # the route that answered
    arm: str
    fallback: str | None  # why diffusion did not answer, None when it did or was not asked
    decision: Decision | None  # route=auto's fan-out decision, None for a forced route
    timings_s: dict[str, float]


class Retriever:
    """A bundle ready to serve: paths, one batcher per path, the router."""

    def __init__(
        self, settings: Settings, metrics: Metrics, bundle: Bundle,
        paths: dict[str, Route], problems: dict[str, str],
    ) -> None:
        self.settings, self.metrics, self.bundle = settings, metrics, bundle
        self.paths, self.problems = paths, problems
        self.filter_fields = metadata_fields(bundle.items.metadata)
        self.batchers: dict[str, Batcher[RouteQuery, RouteAnswer]] = {}
        self.stall = Stall(settings.fault_stall_rate, settings.fault_stall_s, settings.seed)
        self.recent: deque[str] = deque(maxlen=RECENT_QUERIES)  # replayed by a reload
        recorded = recorded_routes(bundle.path)
        self.weights_from = "R4T_ROUTES" if settings.routes else \
            "bundle" if recorded else "default"
        try:
            self.weights = settings.route_weights(recorded)
        except ValueError as exc:  # only a recorded choice can be bad here: settings are checked
            raise BundleError(f"{bundle.path}: its routes stage chose {recorded!r}: {exc}") \
                from exc
        self.router = Router(self.weights, set(paths), settings.seed)
        self.trigger = FanoutTrigger(bundle.lexical, settings.fanout_threshold,
                                     settings.fanout_lead)
        self.warm, self.closed = False, False

    @classmethod
    def load(
        cls, settings: Settings, metrics: Metrics, bundle_dir: Path, loaders: Loaders
    ) -> Retriever:
        """Verify and load a bundle and its runtimes (blocking: call it off the event loop)."""
        set_threads(settings.faiss_threads)
        bundle = load_bundle(bundle_dir, IndexChoice.parse(settings.index),
                             settings.index_timeout_s)
        encoder = Encoder(bundle.encoder_config, settings.threads, settings.provider_list)
        paths, problems = load_routes(settings, bundle, encoder, loaders)
        if not paths:
            raise BundleError(f"bundle {bundle_dir} can serve no retrieval path: {problems}")
        return cls(settings, metrics, bundle, paths, problems)

    def start(self) -> None:
        """Start one batcher per path (needs the running event loop)."""
        s = self.settings
        for name, path in self.paths.items():
            batcher: Batcher[RouteQuery, RouteAnswer] = Batcher(
                name, self._timed(path), max_batch_size=s.max_batch_size,
                max_wait_ms=s.max_wait_ms, queue_size=s.queue_size,
                admit_wait_fraction=s.admit_wait_fraction, nice=s.compute_nice,
                metrics=self.metrics,
            )
            batcher.start()
            self.batchers[name] = batcher

    def _timed(self, path: Route) -> Callable[[Sequence[RouteQuery]], list[RouteAnswer]]:
        def compute(batch: Sequence[RouteQuery]) -> list[RouteAnswer]:
            set_threads(self.settings.faiss_threads)  # OpenMP's cap is per thread: this one's
            self.stall()  # R4T_FAULT_STALL_RATE (chaos tests); nothing by default
            answers = path(batch)
            if answers:
                self.metrics.observe_stages(path.name, answers[0].timings_s)
            if path.cache is not None and path.cache.size:
                for answer in answers:
                    self.metrics.fanout_cache.labels(
                        result="hit" if answer.cached else "miss").inc()
                self.metrics.fanout_cache_entries.set(len(path.cache))
            return answers

        return compute

    def require(self, routes: Iterable[str]) -> None:
        """A BundleError naming each of `routes` this bundle cannot serve, and why."""
        lost = sorted(set(routes) - set(self.paths))
        if lost:
            why = "; ".join(f"{r}: {self.problems.get(r, 'not in the bundle')}" for r in lost)
            raise BundleError(f"{self.bundle.path} lacks routes the service serves ({why})")

    async def warm_up(self, strict: bool, traffic: Sequence[str] = ()) -> None:
        """Run each path end to end; a failing path is dropped (or, if strict, refused). Then
        replay `traffic` (the queries the bundle it replaces answered last) through each path,
        so a reload under load meets warm caches and estimates, not a cold start."""
        for name in list(self.paths):
            deadline = time.monotonic() + WARMUP_DEADLINE_S
            queries = [RouteQuery(WARMUP_QUERIES[i % len(WARMUP_QUERIES)], 10, deadline=deadline)
                       for i in range(self.settings.warmup_queries)]
            try:
                for query in queries[:1]:  # batch of one, then a full warm-up batch
                    await self.batchers[name].submit(query, deadline)
                self.batchers[name].forget_estimates()  # the first run's set-up is not compute
                await asyncio.gather(*(self.batchers[name].submit(q, deadline) for q in queries))
            except Exception as exc:
                reason = f"warm-up failed: {type(exc).__name__}: {exc}"
                if strict:
                    raise BundleError(f"{name} path {reason}") from exc
                log.error("disabling the %s path: %s", name, reason)
                self.problems[name] = reason
                await self.batchers.pop(name).close()
                await asyncio.to_thread(self.paths.pop(name).close)
        if not self.paths:
            raise BundleError(f"no retrieval path survived warm-up: {self.problems}")
        await self._replay(list(dict.fromkeys(traffic)))
        self.router = Router(self.weights, set(self.paths), self.settings.seed)
        self.warm = True
        self.stall.armed = True
        for path in self.paths.values():
            path.arm()  # faults start once the path is serving

    async def _replay(self, texts: list[str]) -> None:
        """Each path answers `texts` (batched as traffic would be); a request-specific error
        is logged, not held against the bundle."""
        if not texts:
            return
        deadline = time.monotonic() + WARMUP_DEADLINE_S
        for name, batcher in self.batchers.items():
            answers = await asyncio.gather(
                *(batcher.submit(RouteQuery(text, 10, deadline=deadline), deadline)
                  for text in texts), return_exceptions=True)
            failed = [a for a in answers if isinstance(a, BaseException)]
            if len(failed) == len(texts):  # what the old bundle answered, this one cannot
                raise BundleError(f"the {name} path failed every one of the {len(texts)} "
                                  f"recent queries replayed (first: {failed[0]!r})")
            if failed:
                log.warning("replaying %d recent queries on the %s path: %d failed (first: %r)",
                            len(texts), name, len(failed), failed[0])

    async def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Close the batchers together (queued work gets `grace_s` in all, not per route),
        then each route in a thread (llama.cpp's close waits for the decode in progress); the
        batchers are dropped, since their compute functions hold this retriever: a cycle that
        would keep the retired bundle until a full collection. Closing twice is a no-op."""
        if self.closed:
            return
        self.closed = True
        closing, self.batchers = list(self.batchers.values()), {}
        await asyncio.gather(*(batcher.close(grace_s) for batcher in closing))
        for path in self.paths.values():
            await asyncio.to_thread(path.close)

    @property
    def providers(self) -> dict[str, list[str]]:
        return {name: path.providers for name, path in self.paths.items()}

    @property
    def routes(self) -> list[str]:
        """The routes this bundle serves, best first."""
        return [name for name in ROUTE_ORDER if name in self.paths]

    @property
    def version(self) -> str:
        m = self.bundle.manifest
        return f"{self.bundle.name}@{m.get('updated') or m.get('created', 'unknown')}"

    def info(self) -> dict[str, Any]:
        return {
            "bundle": {"name": self.bundle.name, "path": str(self.bundle.path),
                       "version": self.version, "manifest": self.bundle.manifest},
            "paths": {name: path.describe() for name, path in self.paths.items()},
            "unavailable": self.problems,
            "providers": self.providers,
            "routing": {"weights": self.router.weights, "sticky_key": "user_id",
                        "weights_from": self.weights_from,
                        "groundedness_threshold": self.settings.groundedness_threshold,
                        "fanout_trigger": self.trigger.describe()},
            "batching": {name: describe(b) for name, b in self.batchers.items()},
        }

    async def retrieve(self, request: RouteQuery, deadline: float) -> Served:
        """Answer one request by its arm, falling back from diffusion to AR, then to single,
        when needed."""
        started = time.monotonic()
        assignment = self.router.assign(request.user_id, request.route)
        decision = await self._decide(request, assignment)
        query = replace(request, where=where_of(request.filter, self.filter_fields),
                        lead=decision.lead if decision is not None else 0, deadline=deadline)
        route = assignment.route if decision is None or decision.fanout else "single"
        reason: str | None = None
        timings: dict[str, float] = {}
        completed: Completed[RouteAnswer] | None = None
        try:
            if route == "diffusion":
                completed, reason = await self._try_diffusion(query, deadline)
                if reason is not None:
                    self.metrics.fallbacks.labels(reason=reason).inc()
                    timings["diffusion_attempt"] = time.monotonic() - started
                    route = self._fallback("diffusion")
            if completed is None:
                completed, route, reason = await self._submit_or_single(
                    route, query, deadline, reason, forced=request.route == route)
        except R4TError as exc:  # the HTTP layer labels the failure with the path tried
            exc.route, exc.arm = route, assignment.arm
            raise
        answer = completed.result
        self.metrics.stage_duration.labels(route=route, stage="queue").observe(completed.queue_s)
        self.metrics.groundedness.labels(route=route).observe(answer.groundedness)
        if answer.selection.filled:
            self.metrics.filled_slots.labels(route=route).inc(answer.selection.filled)
        timings.update({"queue": completed.queue_s, **answer.timings_s})
        timings["total"] = time.monotonic() - started
        self.recent.append(request.text)  # an answered query: a reload replays it
        return Served(answer, route, assignment.arm, reason, decision, timings)

    def _fallback(self, route: str) -> str:
        """The first route of `route`'s fallback chain this bundle serves."""
        return next((r for r in FALLBACKS[route] if r in self.batchers), LAST_ROUTE)

    async def _decide(self, request: RouteQuery, assignment: Assignment) -> Decision | None:
        """route=auto: fan out, or answer with `single`? None when the request forced a route.
        The breadth is scored in a thread: a query's never-seen words cost SQLite statements."""
        if request.route != "auto":
            return None
        if assignment.route == "single":
            decision = Decision(fanout=False, reason="arm")
        elif request.fanout != "auto":  # nothing to score
            decision = self.trigger.decide(request.text, cast(FanoutMode, request.fanout))
        else:
            decision = await asyncio.to_thread(self.trigger.decide, request.text)
        if decision.score is not None:
            self.metrics.breadth.observe(decision.score)
        self.metrics.fanout_decisions.labels(fanout=str(decision.fanout).lower(),
                                             reason=decision.reason).inc()
        return decision

    async def _submit(
        self, route: str, query: RouteQuery, deadline: float, fallback: str | None = None
    ) -> Completed[RouteAnswer]:
        batcher = self.batchers.get(route)
        if batcher is None:
            why = self.problems.get(route, "not loaded")
            before = f"diffusion fallback ({fallback}) impossible: " if fallback else ""
            raise UnavailableError(f"{before}the {route} route is unavailable: {why}")
        return await batcher.submit(query, deadline)

    async def _submit_or_single(
        self, route: str, query: RouteQuery, deadline: float, fallback: str | None, forced: bool
    ) -> tuple[Completed[RouteAnswer], str, str | None]:
        """`route`'s answer, its route and the fallback reason. A failing fan-out route hands
        the query on to `single`, the last route down, with the reason "error" (or the diffusion
        fallback's), as does an AR route too busy for a diffusion fallback; a request that asked
        for ar or ranked itself keeps its error."""
        try:
            return await self._submit(route, query, deadline, fallback), route, fallback
        except (DeadlineError, IndexUnavailableError):
            raise  # single would not do better
        except OverloadError:
            if not fallback or LAST_ROUTE not in self.batchers:
                raise  # a busy arm refuses fast; a fallback finds AR busy: single answers
            log.info("the %s route is busy after a diffusion fallback (%s); answering with "
                     "single", route, fallback)
        except Exception:
            if route == LAST_ROUTE or LAST_ROUTE not in self.batchers or (forced and not fallback):
                raise
            log.warning("the %s route failed (after a diffusion fallback: %s); answering with "
                        "single", route, fallback, exc_info=True)
        if fallback is None:
            fallback = "error"
            self.metrics.fallbacks.labels(reason=fallback).inc()
        return await self._submit(LAST_ROUTE, query, deadline, fallback), LAST_ROUTE, fallback

    async def _try_diffusion(
        self, query: RouteQuery, deadline: float
    ) -> tuple[Completed[RouteAnswer] | None, str | None]:
        """The diffusion answer, or None and the reason to fall back."""
        batcher = self.batchers.get("diffusion")
        if batcher is None:
            return None, "unavailable"
        try:  # a busy diffusion path refuses (429): the slower AR path would not do better
            completed = await batcher.submit(query, deadline)
        except (OverloadError, DeadlineError, IndexUnavailableError):
            raise  # nor would any other route without the index
        except Exception as exc:
            log.warning("diffusion path failed, falling back to AR: %s: %s",
                        type(exc).__name__, exc, exc_info=True)
            return None, "error"
        if query.where is None and \
                completed.result.groundedness < self.settings.groundedness_threshold:
            return None, "quality"  # under a filter, rows sit farther from the allowed items
        return completed, None
