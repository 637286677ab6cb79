"""Bad input gets an OpenAI-style JSON error with the right status, and the server keeps serving."""
from __future__ import annotations

import pytest

from tests.api.conftest import MODEL, metric

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
OK_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}

# (name, path, body: dict or raw bytes, status, expected param or None, words expected in the message)
CASES = [
    ("malformed JSON", COMPLETIONS, b'{"model": "x", "prompt": ', 400, None, "JSON"),
    ("body is not an object", COMPLETIONS, b"[1, 2, 3]", 400, None, "object"),
    ("unknown model", COMPLETIONS, {**OK_COMPLETION, "model": "gpt-17"}, 404, "model", "does not exist"),
    ("missing prompt", COMPLETIONS, {"model": MODEL}, 400, "prompt", "required"),
    ("prompt of wrong type", COMPLETIONS, {**OK_COMPLETION, "prompt": 42}, 400, "prompt", ""),
    ("empty prompt", COMPLETIONS, {**OK_COMPLETION, "prompt": ""}, 400, "prompt", "empty"),
    ("token id out of vocabulary", COMPLETIONS, {**OK_COMPLETION, "prompt": [1, 10**7]}, 400, None, "vocabulary"),
    # Found by the fuzz test: echo decoded the ids before the engine refused them (a 500).
    ("echoed token id out of vocabulary", COMPLETIONS, {**OK_COMPLETION, "prompt": [-91, 516], "echo": True}, 400,
     "prompt", "vocabulary"),
    ("prompt longer than max-model-len", COMPLETIONS, {**OK_COMPLETION, "prompt": "hello " * 9000}, 400, None,
     "maximum model length"),
    ("negative max_tokens", COMPLETIONS, {**OK_COMPLETION, "max_tokens": -5}, 400, "max_tokens", ""),
    ("huge max_tokens", COMPLETIONS, {**OK_COMPLETION, "max_tokens": 10**9}, 400, None, "max_tokens"),
    ("max_tokens of wrong type", COMPLETIONS, {**OK_COMPLETION, "max_tokens": "ten"}, 400, "max_tokens", ""),
    ("temperature below 0", COMPLETIONS, {**OK_COMPLETION, "temperature": -0.5}, 400, "temperature", ""),
    ("temperature above 2", CHAT, {**OK_CHAT, "temperature": 7}, 400, "temperature", ""),
    ("top_p of 0", COMPLETIONS, {**OK_COMPLETION, "top_p": 0}, 400, "top_p", ""),
    ("top_k below -1", COMPLETIONS, {**OK_COMPLETION, "top_k": -3}, 400, "top_k", ""),
    ("n of 0", COMPLETIONS, {**OK_COMPLETION, "n": 0}, 400, "n", ""),
    ("logprobs above 20", COMPLETIONS, {**OK_COMPLETION, "logprobs": 50}, 400, "logprobs", ""),
    ("stop of wrong type", COMPLETIONS, {**OK_COMPLETION, "stop": 3}, 400, "stop", ""),
    ("too many stop strings", COMPLETIONS, {**OK_COMPLETION, "stop": [f"s{i}" for i in range(40)]}, 400, None,
     "stop"),
    ("seed of wrong type", COMPLETIONS, {**OK_COMPLETION, "seed": "abc"}, 400, "seed", ""),
    ("stream of wrong type", COMPLETIONS, {**OK_COMPLETION, "stream": "yes"}, 400, "stream", ""),
    ("stream_options without stream", COMPLETIONS, {**OK_COMPLETION, "stream_options": {"include_usage": True}},
     400, None, "stream"),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages", "required"),
    ("token ids of a tool call", CHAT, {**OK_CHAT, "return_token_ids": True, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, 400,
     "return_token_ids", "tool calls"),
    ("empty messages", CHAT, {**OK_CHAT, "messages": []}, 400, "messages", ""),
    ("unknown role", CHAT, {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role",
     ""),
    ("messages of wrong type", CHAT, {**OK_CHAT, "messages": "Hi"}, 400, "messages", ""),
    ("top_logprobs without logprobs", CHAT, {**OK_CHAT, "top_logprobs": 2}, 400, None, "logprobs"),
    ("penalty out of range", CHAT, {**OK_CHAT, "frequency_penalty": 2.5}, 400, "frequency_penalty", ""),
    ("repetition_penalty of 0", COMPLETIONS, {**OK_COMPLETION, "repetition_penalty": 0}, 400, "repetition_penalty",
     ""),
    ("logit_bias out of range", COMPLETIONS, {**OK_COMPLETION, "logit_bias": {"5": 300}}, 400, None, "logit_bias"),
    ("logit_bias key not a token id", COMPLETIONS, {**OK_COMPLETION, "logit_bias": {"x": 1}}, 400, "logit_bias",
     "token id"),
    ("logit_bias out of vocabulary", COMPLETIONS, {**OK_COMPLETION, "logit_bias": {"99999999": 1}}, 400, None,
     "vocabulary"),
    ("min_tokens above max_tokens", COMPLETIONS, {**OK_COMPLETION, "max_tokens": 3, "min_tokens": 5}, 400, None,
     "min_tokens"),
    ("min_p above 1", CHAT, {**OK_CHAT, "min_p": 1.5}, 400, "min_p", ""),
    ("beam search", COMPLETIONS, {**OK_COMPLETION, "use_beam_search": True}, 400, "use_beam_search",
     "not supported"),
    ("suffix", COMPLETIONS, {**OK_COMPLETION, "suffix": "end"}, 400, "suffix", "no fill-in-the-middle tokens"),
    ("spaces_between_special_tokens off", CHAT, {**OK_CHAT, "spaces_between_special_tokens": False}, 400,
     "spaces_between_special_tokens", "not supported"),
    ("chat echo", CHAT, {**OK_CHAT, "echo": True}, 400, "echo", "not supported"),
    ("unknown field", COMPLETIONS, {**OK_COMPLETION, "temprature": 0.5}, 400, "temprature", "Unrecognized"),
    ("image content", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     400, "messages.0.content", "content part 1 is of type 'image_url'"),
    ("audio content", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, 400, "messages.0.content",
     "only text content is supported"),
    ("a reply's refusal sent back", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "Hi"}, {
        "role": "assistant", "content": "No.", "refusal": "No."}]}, 400, "messages.1.refusal", "not supported"),
    ("a reply's citations sent back", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "Hi"}, {
        "role": "assistant", "content": "x", "annotations": [{"type": "url_citation"}]}]}, 400,
     "messages.1.annotations", "not supported"),
    ("both token limits, differing", CHAT, {**OK_CHAT, "max_tokens": 6, "max_completion_tokens": 3}, 400,
     "max_completion_tokens", "differ"),
    ("a user message without content", CHAT, {**OK_CHAT, "messages": [{"role": "user"}]}, 400,
     "messages.0.content", "needs content"),
    ("temperature NaN", COMPLETIONS, b'{"prompt": "Hi", "max_tokens": 2, "temperature": NaN}', 400, None,
     "NaN is not a JSON number"),
    ("Infinity in a free-form field", COMPLETIONS, b'{"prompt": "Hi", "guided_json": {"maximum": -Infinity}}', 400,
     None, "-Infinity is not a JSON number"),
    ("a number past a float's range", COMPLETIONS, b'{"prompt": "Hi", "top_p": 1e999}', 400, None,
     "beyond a 64-bit float's range"),
    ("continuous usage stats", COMPLETIONS, {**OK_COMPLETION, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}, 400, "stream_options.continuous_usage_stats",
     "not supported"),
    ("prompt_logprobs above 20", COMPLETIONS, {**OK_COMPLETION, "prompt_logprobs": 21}, 400, "prompt_logprobs", ""),
    ("truncate_prompt_tokens of 0", COMPLETIONS, {**OK_COMPLETION, "truncate_prompt_tokens": 0}, 400, None,
     "truncate_prompt_tokens"),
    ("unknown model on chat", CHAT, {**OK_CHAT, "model": "nope"}, 404, "model", ""),
]


def test_table_has_enough_kinds():
    assert len(CASES) >= 15


@pytest.mark.parametrize("name,path,body,status,param,words", CASES, ids=[c[0] for c in CASES])
def test_bad_request(http, name, path, body, status, param, words):
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    assert words.lower() in error["message"].lower()


def test_a_request_too_long_for_the_model_says_so_by_openais_code(http):
    """Clients trim a conversation on code "context_length_exceeded": every endpoint sends it,
    whichever check (before tokenizing, or the engine's) finds the request too long."""
    for path, body in ((COMPLETIONS, {**OK_COMPLETION, "max_tokens": 10**9}),
                       (COMPLETIONS, {**OK_COMPLETION, "prompt": "hello " * 9000}),
                       (CHAT, {**OK_CHAT, "max_tokens": 10**9}),
                       ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 10**9})):
        error = http.post(path, json=body).json()["error"]
        assert error["code"] == "context_length_exceeded", (path, error)


def test_unknown_route_and_method_are_json_errors(http):
    assert http.get("/v1/nothing-here").json()["error"]["code"] == "not_found"
    response = http.get(COMPLETIONS)
    assert response.status_code == 405 and "error" in response.json()


# Fields of OpenAI's and vLLM's requests that the server takes at their "off" value (a client
# library may send them so): they must be answered, not refused.
NO_OPS = {"use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True, "priority": 0,
          "skip_special_tokens": True, "include_stop_str_in_output": False, "best_of": 1, "user": "u-1",
          "suffix": None, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "min_tokens": 0,
          "repetition_penalty": 1.0, "min_p": 0.0, "echo": False}


def test_fields_at_their_off_value_are_accepted(http):
    assert http.post(COMPLETIONS, json={**OK_COMPLETION, **NO_OPS}).status_code == 200
    chat_no_ops = {k: v for k, v in NO_OPS.items() if k not in ("suffix", "best_of")}
    chat = {**OK_CHAT, **chat_no_ops, "tools": [], "tool_choice": "none", "store": False, "metadata": {"a": "b"},
            "response_format": {"type": "text"}, "service_tier": "auto", "modalities": ["text"]}
    assert http.post(CHAT, json=chat).status_code == 200, http.post(CHAT, json=chat).text


def test_a_reply_sent_back_as_the_openai_client_dumps_it_is_taken(http, client):
    """`messages.append(reply.choices[0].message.model_dump())`: every field it adds at its off value."""
    reply = client.chat.completions.create(**OK_CHAT).choices[0].message.model_dump()
    assert {"annotations", "refusal", "audio", "function_call", "tool_calls"} <= set(reply)
    messages = [*OK_CHAT["messages"], reply, {"role": "user", "content": "And then?"}]
    response = http.post(CHAT, json={**OK_CHAT, "messages": messages})
    assert response.status_code == 200, response.text
    reply["annotations"] = []
    assert http.post(CHAT, json={**OK_CHAT, "messages": messages}).status_code == 200
    reply["tool_calls"] = []  # no calls, as some clients spell it
    assert http.post(CHAT, json={**OK_CHAT, "messages": messages}).status_code == 200


def test_good_requests_still_served_after_bad_ones(http, client):
    assert http.post(COMPLETIONS, json=OK_COMPLETION).json()["choices"][0]["finish_reason"] in ("stop", "length")
    reply = client.chat.completions.create(**OK_CHAT)
    assert reply.choices[0].message.content
    page = http.get("/metrics").text
    assert metric(page, "conveyor:num_requests_running") == 0
    assert metric(page, "conveyor:request_rejected_total", reason="invalid") >= 3
