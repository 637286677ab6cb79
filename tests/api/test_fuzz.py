"""Schemathesis against a live server on a tiny random model (issue 18): a few hundred generated
requests, valid and invalid by the served schema, get no 5xx and answers that conform to the
schema, in a content type it declares; schema-valid requests, from the coverage phase (boundary
values of every field) and from fuzzing, are served unless their validity depends on content no
schema can judge (issue 34); afterwards the engine is idle (nothing running or waiting, no KV block
in use)."""
from __future__ import annotations

import re
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api.conftest import httpx, metric  # noqa: E402

EXAMPLES_PER_OPERATION = 50  # x 5 operations, positive and negative cases mixed
POSITIVE_EXAMPLES_PER_OPERATION = 60  # besides every coverage-phase case
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]

# Refusals of schema-valid requests that the schema cannot prevent, as (param, message) patterns:
# validity that depends on content (what a prompt tokenizes to, whether a grammar compiles, what a
# chat template accepts), and the cross-field rules the schema only describes because stating them
# would exceed what schema-driven generators expand (conveyor/api/schema.py). Anything else
# refused is a limit the schema fails to state.
CONTENT_DEPENDENT = [
    (r"prompt|input|messages|max_tokens|max_output_tokens", r"cannot fit|leaves no room|exceeds the maximum model length"),
    (r"guided_\w+|response_format\.json_schema\.schema|structured_outputs\.\w+|tools\.\d+\.(function\.)?parameters"
     r"|text\.format\.schema", r"."),  # a JSON schema, regex or grammar that does not compile
    (r"messages|input", r"chat template rejected the messages"),
    (r"previous_response_id", r"is not stored"),  # described: a response this server stores
    (r"prompt|input", r"is empty"),  # a text the tokenizer reads as no token at all (a lone control character)
    # A field the chat template drops (a Responses function_call item is an assistant's tool_calls).
    (r"messages\.\d+(\.(name|tool_calls|content\.\d+))?|input(\.\d+)?|previous_response_id", r"does not render"),
    (r"continue_final_message", r"does not appear in the rendered chat"),
    (r"bad_words", r"tokens in all"),
    (r"min_tokens", r"max_tokens"),  # described: at most max_tokens
    (r"top_logprobs", r"requires logprobs"),  # described
    (r"max_completion_tokens", r"differ"),  # described: max_tokens, if sent too, the same
    (r"max_tokens", r"only with echo"),  # described: 0 only with echo
    (r"suffix|echo", r"suffix"),  # described: a suffix takes text prompts and no echo
    (r"stream_options", r"only allowed when stream is true"),  # described on chat
    (r"tools|tool_choice(\.function)?(\.name)?", r"needs tools|not in tools|renders the tools|duplicate"),  # described
    (r"(text|output_config)\.format(\.schema)?", r"cannot be combined with tool_choice"),  # described
]


def content_dependent(response) -> bool:
    if response.status_code != 400:
        return False
    error = response.json().get("error", {})
    param, message = error.get("param") or "", error.get("message", "")
    return any(re.fullmatch(p, param) and re.search(m, message) for p, m in CONTENT_DEPENDENT)


def assert_idle(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        page = http.get("/metrics").text
    assert metric(page, "conveyor:num_requests_running") == 0
    assert metric(page, "conveyor:num_requests_waiting") == 0
    assert metric(page, "conveyor:kv_cache_usage_perc") == 0.0


def test_fuzz_the_api(tiny_server):
    schema = schemathesis.openapi.from_url(f"{tiny_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
                                              "/v1/models", "/health"}
    strategy = st.one_of(*(op.as_strategy(generation_mode=mode) for op in operations
                           for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)))
    statuses: dict[int, int] = {}

    @given(case=strategy)
    # Derandomized: the same cases on every run of the same code, so CI and a developer see the
    # same result (random seeds found the echo 500 and the SSE schema gap; each is a test now).
    @settings(max_examples=EXAMPLES_PER_OPERATION * len(operations), deadline=None, database=None,
              suppress_health_check=list(HealthCheck), derandomize=True)
    def fuzz(case) -> None:
        response = case.call(base_url=tiny_server.base_url, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=CHECKS)

    started = time.monotonic()
    fuzz()
    print(f"fuzzed {sum(statuses.values())} requests in {time.monotonic() - started:.1f} s: {statuses}")
    assert not any(code >= 500 for code in statuses), statuses
    assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 20, statuses  # both kinds were exercised
    assert_idle(tiny_server.base_url)


def fuzz_positive(op, check):
    @given(case=op.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE))
    @settings(max_examples=POSITIVE_EXAMPLES_PER_OPERATION, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), derandomize=True)
    def fuzz(case) -> None:
        check(op, case)

    return fuzz


def test_schema_valid_requests_are_served(tiny_server):
    """Positive cases only: the coverage phase's boundary values of every field, then fuzzing."""
    schema = schemathesis.openapi.from_url(f"{tiny_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    outcomes: dict[str, dict[str, int]] = {}  # path -> status (or "excused") -> count

    def check(op, case) -> None:
        response = case.call(base_url=tiny_server.base_url, timeout=60)
        excused = content_dependent(response)
        tally = outcomes.setdefault(op.path, {})
        key = "excused" if excused else str(response.status_code)
        tally[key] = tally.get(key, 0) + 1
        case.validate_response(response, checks=CHECKS if excused else [*CHECKS, positive_data_acceptance])

    for op in operations:
        # The coverage phase as schemathesis' own runner takes it (schemathesis.generation.drivers).
        config = schema.config.generation_for(operation=op, phase="coverage")
        for case in op.schema.iter_coverage_cases(op, generation_modes=[schemathesis.GenerationMode.POSITIVE],
                                                  generation_config=config):
            check(op, case)

        fuzz_positive(op, check)()
    print(f"schema-valid requests by status ('excused': refused for content the schema cannot judge): {outcomes}")
    # The excuses must stay the exception: most schema-valid generations are served as they are.
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
                 "/v1/messages/count_tokens", "/tokenize", "/detokenize"):
        tally = outcomes[path]
        assert tally.get("200", 0) > 2 * tally.get("excused", 0), (path, tally)
    # Anthropic's max_tokens is required: on this server's 64-token context, a generated prompt plus
    # a generated max_tokens often exceeds it, which the schema cannot judge (it depends on how many
    # tokens the prompt's text is). The served must still be the majority.
    tally = outcomes["/v1/messages"]
    assert tally.get("200", 0) > tally.get("excused", 0), ("/v1/messages", tally)
    assert_idle(tiny_server.base_url)
