"""Property-based fuzz of the OpenAPI schema (schemathesis strategies run by hypothesis, valid
and invalid data): no 5xx, and every documented answer matches the schema.

schemathesis's pytest plugin does not support this pytest version, so the test drives the
strategies itself, one operation and generation mode at a time.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 40}
WITH_BODY = ("POST /v1/retrieve", "POST /v1/retrieve:batch", "POST /admin/reload")


@pytest.fixture(scope="module")
def operations(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    return {op.label: op for op in (result.ok() for result in schema.get_all_operations())}


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
def test_fuzzed_requests_never_get_a_5xx(server, operations, mode):
    assert set(WITH_BODY) <= set(operations)
    for label, operation in sorted(operations.items()):
        if label == "GET /metrics":  # text exposition, not JSON: checked in test_app
            continue
        if mode == GenerationMode.NEGATIVE and label not in WITH_BODY:
            continue  # nothing to make invalid

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES[mode], deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case: schemathesis.Case) -> None:
            case.call_and_validate(
                base_url=server.url, checks=[not_a_server_error, response_schema_conformance]
            )

        fuzz()


def test_schema_documents_examples_and_errors(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    components = spec["components"]["schemas"]
    assert components["RetrieveRequest"]["examples"][0]["query"] == "camping gear"
    assert components["RetrieveResponse"]["examples"]
    responses = spec["paths"]["/v1/retrieve"]["post"]["responses"]
    assert {"200", "413", "422", "429", "503", "504"} <= set(responses)
