"""Schemathesis against a live server on a tiny random model (issue 18): a few hundred generated
requests, valid and invalid by the served schema, get no 5xx and answers that conform to the
schema; afterwards the engine is idle (nothing running or waiting, no KV block in use)."""
from __future__ import annotations

import time

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance  # noqa: E402

from tests.api.conftest import httpx, metric  # noqa: E402

EXAMPLES_PER_OPERATION = 50  # x 5 operations, positive and negative cases mixed


def test_fuzz_the_api(tiny_server):
    schema = schemathesis.openapi.from_url(f"{tiny_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    strategy = st.one_of(*(op.as_strategy(generation_mode=mode) for op in operations
                           for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)))
    checks = [not_a_server_error, response_schema_conformance, status_code_conformance]
    statuses: dict[int, int] = {}

    @given(case=strategy)
    # Derandomized: the same cases on every run of the same code, so CI and a developer see the
    # same result (random seeds found the echo 500 and the SSE schema gap; each is a test now).
    @settings(max_examples=EXAMPLES_PER_OPERATION * len(operations), deadline=None, database=None,
              suppress_health_check=list(HealthCheck), derandomize=True)
    def fuzz(case) -> None:
        response = case.call(base_url=tiny_server.base_url, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=checks)

    started = time.monotonic()
    fuzz()
    print(f"fuzzed {sum(statuses.values())} requests in {time.monotonic() - started:.1f} s: {statuses}")
    assert not any(code >= 500 for code in statuses), statuses
    assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 20, statuses  # both kinds were exercised
    with httpx.Client(base_url=tiny_server.base_url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        page = http.get("/metrics").text
    assert metric(page, "conveyor:num_requests_running") == 0
    assert metric(page, "conveyor:num_requests_waiting") == 0
    assert metric(page, "conveyor:kv_cache_usage_perc") == 0.0
