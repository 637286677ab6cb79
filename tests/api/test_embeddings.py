"""POST /v1/embeddings on a real server (the default model), as the openai client and plain HTTP
clients call it: shapes, encodings, usage, vLLM's extensions, and the refusals."""
from __future__ import annotations

import base64
import concurrent.futures
import math
import struct
import time

import pytest

EMBEDDINGS = "/v1/embeddings"
WIDTH = 576  # SmolLM2-135M's hidden size


def embed(http, **fields):  # noqa: ANN001, ANN003, ANN201
    reply = http.post(EMBEDDINGS, json={"model": "smollm2-135m", **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def refused(http, status: int = 400, **fields) -> dict:  # noqa: ANN001, ANN003
    reply = http.post(EMBEDDINGS, json=fields)
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


def test_the_openai_client_gets_one_unit_vector_per_input(client, http) -> None:
    texts = ["The capital of France is", "def add(a, b):\n    return a + b\n"]
    reply = client.embeddings.create(model="smollm2-135m", input=texts)  # the client asks for base64
    assert [d.index for d in reply.data] == [0, 1]
    for item in reply.data:
        assert len(item.embedding) == WIDTH
        assert abs(math.fsum(v * v for v in item.embedding) - 1.0) < 1e-5
    counts = [http.post("/tokenize", json={"prompt": t}).json()["count"] for t in texts]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(counts)
    assert reply.model == "smollm2-135m"
    assert reply.data[0].embedding != reply.data[1].embedding


def test_float_and_base64_carry_the_same_numbers(http) -> None:
    as_floats = embed(http, input="hello world")["data"][0]["embedding"]
    as_text = embed(http, input="hello world", encoding_format="base64")["data"][0]["embedding"]
    decoded = struct.unpack(f"<{WIDTH}f", base64.b64decode(as_text))
    assert list(decoded) == [struct.unpack("<f", struct.pack("<f", v))[0] for v in as_floats]


def test_token_inputs_truncation_and_normalize(http) -> None:
    ids = http.post("/tokenize", json={"prompt": "one two three four five six"}).json()["tokens"]
    from_text = embed(http, input="one two three four five six")["data"][0]["embedding"]
    from_ids = embed(http, input=ids)["data"][0]["embedding"]
    assert from_ids == from_text
    both = embed(http, input=[ids, ids[-3:]])["data"]
    assert both[0]["embedding"] == from_text
    truncated = embed(http, input=ids, truncate_prompt_tokens=3)
    assert truncated["data"][0]["embedding"] == both[1]["embedding"]
    assert truncated["usage"]["prompt_tokens"] == 3
    raw = embed(http, input=ids, normalize=False)["data"][0]["embedding"]
    norm = math.sqrt(math.fsum(v * v for v in raw))
    assert abs(norm - 1.0) > 0.1
    assert max(abs(a / norm - b) for a, b in zip(raw, from_ids)) < 1e-5
    assert len(embed(http, input="x", dimensions=WIDTH, user="someone")["data"][0]["embedding"]) == WIDTH


@pytest.mark.parametrize("fields,param", [
    ({"input": "hi", "dimensions": 64}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [10**7]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ({"input": "hi", "priority": 3}, "priority"),
    ({}, "input"),
    ({"input": "hi", "embed_dtype": "float16"}, "embed_dtype"),
    ({"input": "hi", "cache_salt": ""}, "cache_salt"),
])
def test_bad_fields_are_400s_naming_them(http, fields, param) -> None:
    assert refused(http, **fields)["param"] == param


def test_too_long_an_input_and_an_unknown_model(http) -> None:
    capacity = http.get("/v1/models").json()["data"][0]["max_model_len"]
    error = refused(http, input=[1] * (capacity + 5))
    assert error["param"] == "input" and error["code"] == "context_length_exceeded"
    assert refused(http, 404, input="hi", model="nope")["param"] == "model"


def test_embeddings_run_beside_generation(http) -> None:
    """Sent together with completions, each is answered as if alone."""
    alone = embed(http, input="a shared step")["data"][0]["embedding"]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        completions = [pool.submit(http.post, "/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}) for _ in range(3)]
        embeddings = [pool.submit(embed, http, input="a shared step") for _ in range(3)]
        for future in completions:
            assert future.result().status_code == 200
        for future in embeddings:
            got = future.result()["data"][0]["embedding"]
            assert max(abs(a - b) for a, b in zip(got, alone)) < 1e-5


def test_an_input_may_fill_the_context_and_minus_one_keeps_what_fits(http) -> None:
    """An embedding generates nothing, so its input may hold every token a request can (vLLM's
    limit), and truncate_prompt_tokens: -1 cuts a longer one to that."""
    capacity = http.get("/v1/models").json()["data"][0]["max_model_len"]
    full = embed(http, input=[7] * capacity)
    assert full["usage"]["prompt_tokens"] == capacity
    cut = embed(http, input=[7] * (capacity + 10), truncate_prompt_tokens=-1)
    assert cut["usage"]["prompt_tokens"] == capacity
    assert cut["data"][0]["embedding"] == full["data"][0]["embedding"]


def test_more_inputs_than_the_waiting_queue_holds_are_served(tiny_server) -> None:
    """OpenAI takes 2,048 inputs a request; the server's waiting queue holds 64 (tiny_server): the
    inputs go in waves of a running batch, not refused for good."""
    import httpx

    inputs = [f"passage number {i}" for i in range(150)]
    with httpx.Client(base_url=tiny_server.base_url, timeout=120.0) as tiny:
        reply = tiny.post(EMBEDDINGS, json={"input": inputs})
        assert reply.status_code == 200, reply.text
        data = reply.json()["data"]
        assert [d["index"] for d in data] == list(range(150))
        one = tiny.post(EMBEDDINGS, json={"input": inputs[123]}).json()["data"][0]["embedding"]
    assert max(abs(a - b) for a, b in zip(one, data[123]["embedding"])) < 1e-5


def test_errors_name_the_input_at_fault(http) -> None:
    capacity = http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert refused(http, input=["fine", ""])["message"] == "input[1] is empty"
    error = refused(http, input=["fine", "word " * (capacity + 10)])
    assert error["message"].startswith("input[1] (") and error["code"] == "context_length_exceeded"
    assert embed(http, input="x", embed_dtype="float32", endianness="little", cache_salt="tenant-a")["data"]


def test_a_client_that_leaves_ends_every_input_of_its_request(server, http) -> None:
    """The inputs of a request are handed over at once, so its disconnect is seen at once and aborts
    those not computed yet, as a chat's does."""
    import httpx

    from tests.api.conftest import metric

    def count(name: str, **labels: str) -> float:
        try:
            return metric(http.get("/metrics").text, name, **labels)
        except KeyError:
            return 0.0

    aborted = count("conveyor:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.v1}/embeddings", json={"input": [[11 + i] * 1500 for i in range(40)]}, timeout=0.5)
    deadline = time.monotonic() + 30
    while count("conveyor:request_success_total", finished_reason="abort") - aborted < 20:  # of 40, ~1 a second
        assert time.monotonic() < deadline, "the inputs were not aborted"
        time.sleep(0.05)
    while count("conveyor:num_requests_running") + count("conveyor:num_requests_waiting") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert count("conveyor:kv_cache_usage_perc") == 0.0


def test_a_request_id_in_use_is_refused_without_harm_to_its_holder(http) -> None:
    """vLLM's rule: a request_id in flight is a 400 for the second request; the first one, whose
    inputs are still computing, is served whole. (An id is in flight while its input of the same
    index is: the first's input 0 is long, so that the second, of one input, meets it.)"""
    from tests.api.conftest import metric

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(http.post, EMBEDDINGS, json={"input": [[21] * 6000] + [[22 + i] * 1500 for i in range(11)],
                                                         "request_id": "same"})
        deadline = time.monotonic() + 30
        # The second is sent once the first is running (sent before, it would be served: no id is
        # in flight yet); its 6,000-token input 0 then takes seconds to compute.
        while metric(http.get("/metrics").text, "conveyor:num_requests_running") < 1:
            assert time.monotonic() < deadline and not first.done()
            time.sleep(0.01)
        second = http.post(EMBEDDINGS, json={"input": "x", "request_id": "same"})
        assert second.status_code == 400 and second.json()["error"]["param"] == "request_id", second.text
        reply = first.result()
    assert reply.status_code == 200 and len(reply.json()["data"]) == 12
