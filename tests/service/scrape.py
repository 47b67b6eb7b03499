"""What tests read off the live service: Prometheus samples from /metrics, and answers' items."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric_samples(text: str, name: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]


def metric(source: str | Any, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`, read from a base URL or an
    HTTP client's /metrics."""
    text = (httpx.get(f"{source}/metrics", timeout=10.0) if isinstance(source, str)
            else source.get("/metrics")).text
    return sum(s.value for s in metric_samples(text, name)
               if all(s.labels.get(key) == value for key, value in labels.items()))


def assert_k_unique(body: dict, k: int) -> None:
    ids = [item["id"] for item in body["items"]]
    assert len(ids) == k
    assert len(set(ids)) == k
