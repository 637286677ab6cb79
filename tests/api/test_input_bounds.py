"""Issue 18 against the real server: values that broke the shared step or gave garbage (cases 1,
4), invalid Unicode and deep nesting (2, 3), bodies and prompts bounded before work (5), the
schema served (7). Every refusal is a 4xx naming the field; the server stays healthy."""
from __future__ import annotations

import json
import threading
import time

import psutil
import pytest

from tests.api.conftest import MODEL, httpx, metric

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GREEDY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def raw_post(http, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": "application/json"})


def test_top_k_beyond_int64_spares_the_requests_beside_it(http, server):
    results: dict[str, httpx.Response] = {}

    def greedy_stream() -> None:
        with httpx.Client(base_url=server.base_url, timeout=120) as own:
            results["good"] = own.post(COMPLETIONS, json={**GREEDY, "max_tokens": 24, "ignore_eos": True})

    alone = http.post(COMPLETIONS, json={**GREEDY, "max_tokens": 24, "ignore_eos": True}).json()
    beside = threading.Thread(target=greedy_stream)
    beside.start()
    huge = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "top_k": 9223372036854775808,
                                        "max_tokens": 2})
    beside.join(120)
    assert huge.status_code == 200, huge.text
    assert results["good"].status_code == 200
    assert results["good"].json()["choices"][0]["text"] == alone["choices"][0]["text"]


def test_a_temperature_under_epsilon_is_greedy(http):
    greedy = http.post(COMPLETIONS, json=GREEDY).json()["choices"][0]["text"]
    tiny = http.post(COMPLETIONS, json={**GREEDY, "temperature": 1e-50}).json()["choices"][0]["text"]
    assert tiny == greedy and greedy.startswith(" Paris")


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}' % MODEL.encode(), "prompt"),
    (COMPLETIONS, b'{"prompt": ["ok", "\\udc00"], "max_tokens": 2}', "prompt.1"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x\\ud800"}], "max_tokens": 2}', "messages.0.content"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages.0.content.0.text"),
    (COMPLETIONS, b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop.0"),
], ids=["prompt", "prompt list", "chat content", "content part", "stop"])
def test_a_lone_surrogate_is_a_400_naming_the_field(http, path, body, param):
    response = raw_post(http, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"]


@pytest.mark.parametrize("path,field", [(COMPLETIONS, "prompt"), (CHAT, "messages")])
def test_deep_nesting_is_a_400_naming_the_field(http, path, field):
    deep = b"[" * 100_000 + b"]" * 100_000
    response = raw_post(http, path, b'{"model": "%s", "%s": %s}' % (MODEL.encode(), field.encode(), deep))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "nests" in error["message"]


def test_a_body_over_the_limit_is_413_at_once(http):
    body = json.dumps({"model": MODEL, "prompt": "x" * 20_000_000}).encode()
    start = time.monotonic()
    response = raw_post(http, COMPLETIONS, body)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"
    assert time.monotonic() - start < 5  # not read, not tokenized (it took 18.8 s)


def test_a_chunked_body_over_the_limit_is_413_without_buffering_it(http, server):
    proc = psutil.Process(server.proc.pid)
    before = proc.memory_info().rss

    def chunks():  # no Content-Length: the server must count as it reads
        yield b'{"prompt": "'
        for _ in range(400):  # 40 MB offered, 10x the default limit
            yield b"y" * 100_000

    try:
        response = http.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
        assert response.status_code == 413
    except httpx.TransportError:
        pass  # the server answered 413 and closed the connection while the client still sent
    assert proc.memory_info().rss - before < 32 * 2**20  # at most the limit was ever held


@pytest.mark.parametrize("prompt,unit", [(list(range(5, 3_005)) * 100, "tokens"), ("word " * 700_000, "characters")],
                         ids=["token ids", "text"])
def test_a_prompt_that_cannot_fit_is_refused_before_work(http, server, prompt, unit):
    proc = psutil.Process(server.proc.pid)
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()
    assert len(body) < 4 * 2**20
    raw_post(http, COMPLETIONS, body)  # warm the allocator once
    before = proc.memory_info().rss
    start = time.monotonic()
    for _ in range(3):
        response = raw_post(http, COMPLETIONS, body)
        assert response.status_code == 400, response.text
    elapsed = (time.monotonic() - start) / 3
    error = response.json()["error"]
    assert error["param"] == "prompt" and unit in error["message"] and "maximum model length" in error["message"]
    assert elapsed < 2.0  # tokenizing 3.5 MB would take seconds
    assert proc.memory_info().rss - before < 64 * 2**20  # memory is given back


def test_the_schema_and_docs_are_served(http):
    schema = http.get("/openapi.json").json()
    post = schema["paths"]["/v1/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    assert "CompletionResponse" in json.dumps(post["responses"]["200"])
    assert {"400", "413", "500", "503"} <= set(post["responses"])
    assert "ChatCompletionRequest" in schema["components"]["schemas"]
    assert http.get("/docs").status_code == 200


def test_metrics_are_declared_and_served_as_text(http):
    declared = http.get("/openapi.json").json()["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(declared) == ["text/plain"]
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


VOCAB = 49152  # SmolLM2's
CHAT_HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CONTINUED = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]


@pytest.mark.parametrize("path,body,served", [
    ("/detokenize", {"tokens": [VOCAB - 1]}, True),
    ("/detokenize", {"tokens": [VOCAB]}, False),
    (COMPLETIONS, {**GREEDY, "max_tokens": 2, "best_of": 1}, True),
    (COMPLETIONS, {**GREEDY, "max_tokens": 2, "best_of": 2}, False),
    (COMPLETIONS, {**GREEDY, "max_tokens": 2, "n": 2, "best_of": 1}, False),
    (COMPLETIONS, {**GREEDY, "max_tokens": 2, "stream_options": {"include_usage": True}}, False),
    (COMPLETIONS, {**GREEDY, "prompt": [1, VOCAB - 1]}, True),
    (COMPLETIONS, {**GREEDY, "prompt": [1, VOCAB]}, False),
    (COMPLETIONS, {**GREEDY, "prompt": ""}, False),
    (COMPLETIONS, {**GREEDY, "logit_bias": {str(VOCAB - 1): 5}}, True),
    (COMPLETIONS, {**GREEDY, "logit_bias": {str(VOCAB): 5}}, False),
    (COMPLETIONS, {**GREEDY, "priority": 1}, False),  # this server schedules fcfs
    (COMPLETIONS, {**GREEDY, "guided_regex": "a", "guided_choice": ["b"]}, False),
    (COMPLETIONS, {**GREEDY, "max_tokens": 2.0, "n": 2.0, "seed": 7.0}, True),  # JSON's integers
    (CHAT, {**CHAT_HI, "chat_template_kwargs": {"no_such_variable": 1}}, False),
    ("/tokenize", {"messages": CONTINUED, "continue_final_message": True, "add_generation_prompt": False}, True),
    ("/tokenize", {"messages": CONTINUED, "continue_final_message": True, "add_generation_prompt": True}, False),
])
def test_the_schema_admits_what_the_server_serves(http, path, body, served):
    """Issue 34: the limits the server enforces are in /openapi.json, so the schema and the server
    agree on each of these bodies, on either side of a limit."""
    jsonschema = pytest.importorskip("jsonschema")
    spec = http.get("/openapi.json").json()
    body_schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    valid = jsonschema.Draft202012Validator({**body_schema, "components": spec["components"]}).is_valid(body)
    response = http.post(path, json=body)
    assert (valid, response.status_code) == ((True, 200) if served else (False, 400)), response.text


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {**GREEDY, "max_tokens": 10**9}, "max_tokens"),
    (COMPLETIONS, {**GREEDY, "prompt": [1, 10**7]}, "prompt"),
    (COMPLETIONS, {**GREEDY, "stop": [f"s{i}" for i in range(40)]}, "stop"),
    (COMPLETIONS, {**GREEDY, "n": 16, "max_tokens": 2, "seed": 2**63 - 2}, "seed"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, "max_tokens"),
], ids=["max_tokens", "vocabulary", "stop", "seed + n", "chat max_tokens"])
def test_engine_refusals_name_the_field(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_still_healthy_and_idle_afterwards(http):
    assert http.get("/health").status_code == 200
    page = http.get("/metrics").text
    assert metric(page, "conveyor:num_requests_running") == 0
    assert metric(page, "conveyor:kv_cache_usage_perc") == 0.0
