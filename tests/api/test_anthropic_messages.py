"""Anthropic's Messages API (/v1/messages) through the official anthropic client on the real
Qwen2.5-Coder-0.5B-Instruct, in-process over the real engine: the same text as the chat it amounts
to, streamed events that add up to the whole message, tool_use and tool_result blocks, stop
sequences, JSON output, token counting, x-api-key, and errors in Anthropic's envelope naming the
field at fault."""
from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from tests.api import coder_app
from tests.api.coder_app import MODEL

app, http = coder_app.app, coder_app.http  # the real model's app, one for this module

anthropic = pytest.importorskip("anthropic")

GREEDY = {"temperature": 0}  # sent in extra_body: newer anthropic clients no longer take sampling fields
WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}
AS_CHAT_TOOL = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}


@pytest.fixture(scope="module")
def client(http: TestClient) -> Any:
    return anthropic.Anthropic(base_url="http://testserver", api_key="unused", http_client=http, max_retries=0)


def create(client: Any, **kwargs: Any) -> Any:
    return client.messages.create(model=MODEL, extra_body=GREEDY, **kwargs)


def chat(http: TestClient, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "temperature": 0, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_message_is_the_chat_it_amounts_to(client, http):
    message = create(client, max_tokens=24, system="Answer in one short sentence.",
                     messages=[{"role": "user", "content": "What is a Python tuple?"}])
    same = chat(http, [{"role": "system", "content": "Answer in one short sentence."},
                       {"role": "user", "content": "What is a Python tuple?"}], max_tokens=24)
    choice = same["choices"][0]
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == choice["message"]["content"]
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice["finish_reason"]]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == same["usage"]["prompt_tokens"]
    assert usage.output_tokens == same["usage"]["completion_tokens"]
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == MODEL
    # System as text blocks, content as text blocks: the same prompt.
    blocks = create(client, max_tokens=24, system=[{"type": "text", "text": "Answer in one short "},
                                                   {"type": "text", "text": "sentence."}],
                    messages=[{"role": "user", "content": [{"type": "text", "text": "What is a Python tuple?"}]}])
    assert blocks.content[0].text == message.content[0].text


def test_streamed_events_add_up_to_the_whole_message(client):
    ask = dict(max_tokens=16, messages=[{"role": "user", "content": "Name three sorting algorithms."}])
    whole = create(client, **ask)
    with client.messages.stream(model=MODEL, extra_body=GREEDY, **ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_tool_use_and_its_result(client, http):
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    named = create(client, max_tokens=40, messages=ask, tools=[WEATHER],
                   tool_choice={"type": "tool", "name": "get_weather"})
    (call,) = named.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert named.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    same = chat(http, ask, max_tokens=40, tools=[AS_CHAT_TOOL],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(same["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == call.input
    # Streamed: the input arrives as input_json_delta parts that add up to it.
    with client.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=40, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    parts = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(parts) > 1 and json.loads("".join(parts)) == call.input == final.content[0].input
    # The result goes back as a tool_result block: the prompt is the chat's with a tool turn.
    turns = [*ask, {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in named.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "-3 C, snow"}]}]
    answer = create(client, max_tokens=16, messages=turns, tools=[WEATHER])
    same = chat(http, [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "-3 C, snow"}], max_tokens=16, tools=[AS_CHAT_TOOL])
    usage = answer.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == same["usage"]["prompt_tokens"]
    counted = client.messages.count_tokens(model=MODEL, messages=turns, tools=[WEATHER])
    assert counted.input_tokens == same["usage"]["prompt_tokens"]
    # "any" is the chat's "required": some tool is called.
    anyone = create(client, max_tokens=40, messages=ask, tools=[WEATHER], tool_choice={"type": "any"})
    assert [block.type for block in anyone.content] == ["tool_use"]


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    ask = dict(max_tokens=24, messages=[{"role": "user", "content": "List the weekdays, comma-separated."}])
    text = create(client, **ask).content[0].text
    stop = text[len(text) // 2: len(text) // 2 + 4]
    assert stop.strip()
    cut = create(client, stop_sequences=[stop], **ask)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_json_output_follows_the_schema(client):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    message = create(client, max_tokens=40, messages=[{"role": "user", "content": "Bob is 30. Give him as JSON."}],
                     output_config={"format": {"type": "json_schema", "schema": person}})
    jsonschema.validate(json.loads(message.content[0].text), person)


@pytest.mark.parametrize("body, param", [
    (dict(messages=[{"role": "user", "content": "Hi"}]), "max_tokens"),
    (dict(max_tokens=4, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages.0.content.0.type"),
    (dict(max_tokens=4, messages=[{"role": "user", "content": "Hi"}], tools=[{"type": "web_search_20250305",
                                                                             "name": "web_search"}]),
     "tools.0.type"),
    (dict(max_tokens=4, messages=[{"role": "user", "content": "Hi"}], thinking={"type": "enabled",
                                                                                "budget_tokens": 1024}),
     "thinking.type"),
    (dict(max_tokens=4, messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER], tool_choice={"type": "tool"}),
     "tool_choice"),
    (dict(max_tokens=4, messages=[{"role": "user", "content": "Hi"}], temperature=1.5), "temperature"),
    (dict(max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
          output_config={"format": {"type": "json_schema", "schema": {"type": "frob"}}}),
     "output_config.format.schema"),
    (dict(max_tokens=4, messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER],
          tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
    (dict(max_tokens=4, messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]),
     "messages.0.content.0"),
    (dict(max_tokens=4, messages=[{"role": "user", "content": "Hi"}], frobnicate=1), "frobnicate"),
    (dict(max_tokens=4, messages=[{"role": "user", "content": "Hi"}], max_tokens_to_sample=3), "max_tokens_to_sample"),
    (dict(max_tokens=10**6, messages=[{"role": "user", "content": "Hi"}]), "max_tokens"),
    (dict(max_tokens=4, messages=[{"role": "user", "content": "Hi"}], stop_sequences=[""]), "stop_sequences"),
    (dict(max_tokens=4, messages=[{"role": "user", "content": []}]), "messages.0.content"),
    (dict(max_tokens=4, messages=[{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "1"}]}]), "messages.0"),
])
def test_errors_are_anthropics_envelope_naming_the_field(http, body, param):
    reply = http.post("/v1/messages", json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param and error["error"]["message"]


def test_a_last_assistant_message_is_continued_as_anthropics_prefill(client, http):
    ask = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is"}]
    message = create(client, max_tokens=8, messages=ask)
    same = chat(http, ask, max_tokens=8, add_generation_prompt=False, continue_final_message=True)
    assert message.content[0].text == same["choices"][0]["message"]["content"]


def test_turns_are_combined_as_anthropic_combines_them(client):
    """Consecutive turns of one role are one; a system message in place is taken too."""
    def count(messages: list[dict[str, Any]], **kwargs: Any) -> int:
        return client.messages.count_tokens(model=MODEL, messages=messages, **kwargs).input_tokens

    assert count([{"role": "user", "content": "Hello."}, {"role": "user", "content": "Who are you?"}]) == \
        count([{"role": "user", "content": "Hello.\nWho are you?"}])
    assert count([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]) == \
        count([{"role": "user", "content": "Hi"}], system="Be brief.")


def test_a_call_whose_arguments_are_no_object_goes_back_as_text():
    from conveyor.api.anthropic_messages import _tool_use

    assert _tool_use("call_1", "f", '{"a": 1}') == {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}
    for arguments in ('{"a": NaN}', '{"a": 1e999}', '"x"', '{"a": '):
        block = _tool_use("call_1", "f", arguments)
        assert block["type"] == "text" and arguments in json.loads(block["text"])["arguments"]


def test_a_full_queue_is_anthropics_529():
    from starlette.requests import Request

    from conveyor.api.errors import respond, unavailable

    def scope(path: str) -> Request:
        return Request({"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""})

    reply = respond(scope("/v1/messages"), unavailable("the waiting queue is full"))
    assert reply.status_code == 529 and json.loads(reply.body)["error"]["type"] == "overloaded_error"
    assert respond(scope("/v1/chat/completions"), unavailable("the waiting queue is full")).status_code == 503


def test_the_key_goes_in_x_api_key_or_as_a_bearer(app):
    http, state = app
    state.api_key = "sekret"
    try:
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        refused = http.post("/v1/messages", json=body)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        assert http.post("/v1/messages", json=body, headers={"x-api-key": "sekret"}).status_code == 200
        assert http.post("/v1/messages", json=body, headers={"authorization": "Bearer sekret"}).status_code == 200
        assert http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"}).status_code == 401
    finally:
        state.api_key = None


def test_the_engine_is_idle_after_all_of_it(app):
    engine = app[1].engine.engine
    assert not engine.has_unfinished_requests and not engine.scheduler.kv.block_tables


def test_a_chat_message_error_names_the_block_it_came_from():
    """The chat's messages do not line up with Anthropic's (a system message first, a tool
    message per tool_result, combined turns): an error names what the client sent."""
    from conveyor.api.anthropic_messages import CHAT_FIELDS, CountTokensRequest
    from conveyor.api.chat_translation import renamed
    from conveyor.api.errors import bad_request

    request = CountTokensRequest.model_validate({"system": "Be brief.", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "t1", "name": "w", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                     {"type": "text", "text": "And tomorrow?"}]}]})
    messages, fields = request.chat_messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert fields == {"messages.0": "system", "messages.1": "messages.0", "messages.2": "messages.1",
                      "messages.2.tool_calls": "messages.1.content.1", "messages.2.tool_calls.0": "messages.1.content.1",
                      "messages.3": "messages.2.content.0",
                      "messages.4": "messages.2"}
    error = renamed(bad_request("x", param="messages.2.tool_calls.0.function.name"), CHAT_FIELDS, fields)
    assert error.param == "messages.1.content.1"
    assert renamed(bad_request("x", param="tools.0.function.parameters"), CHAT_FIELDS).param == "tools.0.input_schema"
