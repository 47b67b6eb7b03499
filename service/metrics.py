"""Every Prometheus metric of the service, `r4t_` prefix, durations in seconds, explicit buckets.

Each app owns its `CollectorRegistry`, so two apps in one process (tests, a reload) never
share or collide on metrics.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 10.0, 30.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
BREADTH_BUCKETS = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0)


class Metrics:
    """The service's metrics, registered in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.request_duration = Histogram(
            "r4t_request_duration_seconds", "End-to-end request duration.",
            ("route", "arm", "status"), buckets=LATENCY_BUCKETS, registry=r,
        )
        self.stage_duration = Histogram(
            "r4t_stage_duration_seconds",
            "Duration of a pipeline stage (queue per request; compute stages per batch).",
            ("route", "stage"), buckets=LATENCY_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "r4t_batch_size", "Requests per computed batch.", ("route",),
            buckets=BATCH_BUCKETS, registry=r,
        )
        self.queue_depth = Gauge(
            "r4t_queue_depth", "Requests waiting in a route's queue.", ("route",), registry=r
        )
        self.in_flight = Gauge("r4t_in_flight", "Retrieval requests being served.", registry=r)
        self.ready = Gauge("r4t_ready", "1 once a bundle is loaded and warmed up.", registry=r)
        self.rejected = Counter(
            "r4t_rejected_requests", "Requests refused, by reason.", ("reason",), registry=r
        )
        self.fallbacks = Counter(
            "r4t_fallbacks", "Requests answered by a route further down, by reason.",
            ("reason",), registry=r,
        )
        self.skipped = Counter(
            "r4t_skipped_requests", "Queued requests dropped before compute, by reason.",
            ("route", "reason"), registry=r,
        )
        self.groundedness = Histogram(
            "r4t_groundedness", "Content-side groundedness of answers (mean cos to items).",
            ("route",), buckets=RATIO_BUCKETS, registry=r,
        )
        self.filled_slots = Counter(
            "r4t_filled_slots", "AR slots filled from the query's dense neighbours.",
            ("route",), registry=r,
        )
        self.fanout_decisions = Counter(
            "r4t_fanout_decisions", "route=auto requests fanned out or answered by single, by "
            "reason.", ("fanout", "reason"), registry=r,
        )
        self.breadth = Histogram(
            "r4t_query_breadth", "Breadth score of route=auto queries (the fan-out trigger's).",
            buckets=BREADTH_BUCKETS, registry=r,
        )
        self.fanout_cache = Counter(
            "r4t_fanout_cache_lookups", "AR fan-outs looked up in the expansion cache, by "
            "result (hit rate = hit / all).", ("result",), registry=r,
        )
        self.fanout_cache_entries = Gauge(
            "r4t_fanout_cache_entries", "Fan-outs held in the AR expansion cache.", registry=r
        )
        self.bundle = Info("r4t_bundle", "The bundle being served.", registry=r)
        self.reloads = Counter(
            "r4t_reloads", "Bundle reloads, by outcome.", ("outcome",), registry=r
        )

    def observe_stages(self, route: str, timings_s: dict[str, float]) -> None:
        for stage, seconds in timings_s.items():
            self.stage_duration.labels(route=route, stage=stage).observe(seconds)

    def set_bundle(self, version: str, encoder: str, provider: str) -> None:
        self.bundle.info({"version": version, "encoder": encoder, "provider": provider})

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
