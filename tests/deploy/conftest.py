"""Deployment tests reuse the service's real serving bundle and stand-in completion server."""

from tests.service.conftest import (  # noqa: F401  (fixtures)
    benchmark_queries,
    completion_server,
    serving_bundle,
)
