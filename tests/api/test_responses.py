"""OpenAI's Responses API (/v1/responses) through the official openai client on the real
Qwen2.5-Coder-0.5B-Instruct (whose chat template renders tools), in-process over the real engine:
the same text as the chat it amounts to, streamed events that add up to the whole response,
stored responses continued with previous_response_id, function calls and their outputs, JSON
output, logprobs, truncation, and 400s that name the Responses field at fault."""
from __future__ import annotations

import json
from typing import Any, Iterator

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from conveyor.api.app import ServerState

from conveyor.api.errors import APIError
from conveyor.api.generation import Choice
from conveyor.api.openai_responses import ResponseInputItem, ResponseBuilder, ResponsesRequest, ResponseStore, StoredResponse
from conveyor.api.responses import ChatFormat
from conveyor.api.tools import ToolCallFormat, plan_tools
from tests.api.conftest import in_process_app

MODEL = "qwen2.5-coder-0.5b"
CONTEXT = 512  # short, so that truncation is cheap to reach
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
# The chat's tool: strict, as OpenAI's Responses API makes a function tool by default.
AS_CHAT_TOOL = {"type": "function", "function": {**{k: v for k, v in WEATHER.items() if k != "type"}, "strict": True}}


@pytest.fixture(scope="module")
def app() -> Iterator[tuple[TestClient, ServerState]]:
    yield from in_process_app(MODEL, num_kv_blocks=96, max_num_seqs=4, max_model_len=CONTEXT)


@pytest.fixture(scope="module")
def http(app: tuple[TestClient, ServerState]) -> TestClient:
    return app[0]


@pytest.fixture(scope="module")
def client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def chat_text(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.responses.create(model=MODEL, temperature=0, **kwargs)


def error_of(http: TestClient, **body: Any) -> dict[str, Any]:
    reply = http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 4, **body})
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


def test_a_response_is_the_chat_it_amounts_to(client):
    response = create(client, instructions="Answer in one short sentence.", input="What is a Python list?",
                      max_output_tokens=24)
    chat = chat_text(client, [{"role": "system", "content": "Answer in one short sentence."},
                              {"role": "user", "content": "What is a Python list?"}], max_tokens=24)
    choice = chat.choices[0]
    assert response.output_text == choice.message.content and response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert response.id.startswith("resp_") and response.object == "response" and response.store
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    # Input items in every shape a client sends them say the same.
    items = [{"role": "developer", "content": "Answer in one short sentence."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is a Python "},
                                                             {"type": "input_text", "text": "list?"}]}]
    assert create(client, input=items, max_output_tokens=24).output_text == response.output_text


def test_cut_at_max_output_tokens_is_incomplete(client):
    response = create(client, input="Count from one to fifty in words.", max_output_tokens=6)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 6


def test_streamed_events_add_up_to_the_whole_response(client):
    ask = dict(input="Name three sorting algorithms.", max_output_tokens=20)
    whole = create(client, **ask)
    with client.responses.stream(model=MODEL, temperature=0, **ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.id == events[0].response.id and final.status == whole.status
    assert final.output[0].id == events[2].item.id  # the item streamed is the one in the response
    assert final.usage.output_tokens == whole.usage.output_tokens >= len(deltas) > 1
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored when streamed too


def sse_events(text: str) -> list[dict[str, Any]]:
    """The events of a Responses stream, each checked to name its type in its `event:` line."""
    events = []
    for block in text.strip().split("\n\n"):
        head, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    return events


def test_every_event_and_response_is_what_the_sdk_types_say(http):
    """Validated strictly against the openai SDK's own models (a lenient client would not notice
    a missing field), streamed and not, with text, a function call, logprobs and a cut."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    any_event = TypeAdapter(ResponseStreamEvent)
    asks = [dict(input="Say hello.", max_output_tokens=6, include=["message.output_text.logprobs"], top_logprobs=2),
            dict(input="Weather in Oslo?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                 max_output_tokens=4),
            dict(input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", max_output_tokens=40)]
    for ask in asks:
        whole = http.post("/v1/responses", json={"model": MODEL, "temperature": 0, **ask}).json()
        Response.model_validate(whole, strict=True)
        streamed = http.post("/v1/responses", json={"model": MODEL, "temperature": 0, "stream": True, **ask})
        events = sse_events(streamed.text)
        for event in events:
            any_event.validate_python(event, strict=True)
        final = events[-1]["response"]
        assert [i["type"] for i in final["output"]] == [i["type"] for i in whole["output"]]
        assert [i.get("arguments") for i in final["output"]] == [i.get("arguments") for i in whole["output"]]
        assert final["status"] == whole["status"]
        assert [i["status"] for i in final["output"]] == [i["status"] for i in whole["output"]]
        # Each stored response is the one POST answered, field for field.
        assert http.get(f"/v1/responses/{whole['id']}").json() == whole
    # A call cut at max_output_tokens is incomplete, so an agent will not run its broken arguments.
    cut = http.post("/v1/responses", json={"model": MODEL, "temperature": 0, **asks[1]}).json()
    assert cut["status"] == "incomplete" and cut["output"][0]["status"] == "incomplete"


def test_request_id_names_the_engines_request(app, monkeypatch):
    http, state = app
    seen: list[str] = []
    add = state.engine.add_request

    async def recording(request_id: str, *args: Any, **kwargs: Any) -> None:
        seen.append(request_id)
        await add(request_id, *args, **kwargs)

    monkeypatch.setattr(state.engine, "add_request", recording)
    reply = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                             "request_id": "mine-1"})
    assert reply.status_code == 200 and seen == ["resp-mine-1-0"]
    assert reply.json()["id"].startswith("resp_")  # the response's own id: a caller's cannot overwrite another's
    unnamed = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}).json()
    assert seen[1] == f"resp-{unnamed['id'].removeprefix('resp_')}-0"  # the log's id is the response's


def test_previous_response_id_continues_the_conversation(client, http):
    first = create(client, input="Pick a colour.", max_output_tokens=12)
    second = create(client, input="Why that one?", previous_response_id=first.id, max_output_tokens=12)
    chat = chat_text(client, [{"role": "user", "content": "Pick a colour."},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "Why that one?"}], max_tokens=12)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    # A chain of three: the first turn is still there.
    third = create(client, input="Thanks.", previous_response_id=second.id, max_output_tokens=4)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    # Stored whole; deleted, it is gone, and so is whatever continues it.
    stored = http.get(f"/v1/responses/{first.id}").json()
    assert stored["id"] == first.id and stored["output"][0]["id"] == first.output[0].id
    assert stored["output"][0]["content"][0]["text"] == first.output_text and stored["usage"]["output_tokens"] == \
        first.usage.output_tokens
    assert http.delete(f"/v1/responses/{first.id}").json() == {"id": first.id, "object": "response", "deleted": True}
    assert http.get(f"/v1/responses/{first.id}").status_code == 404
    assert http.delete(f"/v1/responses/{first.id}").status_code == 404
    # A stored response holds its whole conversation: the one it continued may go.
    after = create(client, input="Thanks.", previous_response_id=second.id, max_output_tokens=4)
    assert after.usage.input_tokens == third.usage.input_tokens
    error = error_of(http, input="Hi", previous_response_id=first.id)
    assert error["param"] == "previous_response_id" and first.id in error["message"]
    unstored = create(client, input="Hi", store=False, max_output_tokens=2)
    assert not unstored.store and http.get(f"/v1/responses/{unstored.id}").status_code == 404
    assert error_of(http, input="Hi", previous_response_id="resp_nope")["code"] == "previous_response_not_found"


def test_function_calls_and_their_outputs(client, http):
    ask = "What is the weather in Oslo?"
    named = create(client, input=ask, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                   max_output_tokens=32)
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed" and named.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The same call the chat makes.
    chat = chat_text(client, [{"role": "user", "content": ask}], tools=[AS_CHAT_TOOL], max_tokens=32,
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments

    # Streamed: the arguments arrive as deltas of one item and add up to the call.
    with client.responses.stream(model=MODEL, temperature=0, input=ask, tools=[WEATHER], max_output_tokens=32,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 1 and "".join(deltas) == done.arguments == call.arguments
    assert events[-1].response.output[0].call_id == added[0].item.call_id

    # Its output sent back, after the stored call: the prompt is the chat's with a tool turn.
    answer = create(client, previous_response_id=named.id, tools=[WEATHER], max_output_tokens=16,
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "-3 C, snow"}])
    turn = [{"role": "user", "content": ask},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "-3 C, snow"}]
    chat = chat_text(client, turn, tools=[AS_CHAT_TOOL], max_tokens=16)
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    # The call's arguments are in the prompt as the JSON they are, not a quoted string of it.
    tokens = http.post("/tokenize", json={"messages": turn}).json()
    prompt = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    arguments = json.dumps(json.loads(call.arguments))  # as the template's tojson writes the object
    assert f'"arguments": {arguments}' in prompt, prompt
    assert answer.output_text == (chat.choices[0].message.content or "")
    # Sent back by hand (stateless, as the SDK dumps the items) it is the same prompt.
    manual = create(client, tools=[WEATHER], max_output_tokens=16, store=False,
                    input=[{"role": "user", "content": ask}, named.output[0].model_dump(exclude_none=True),
                           {"type": "function_call_output", "call_id": call.call_id, "output": "-3 C, snow"}])
    assert manual.usage.input_tokens == answer.usage.input_tokens and manual.output_text == answer.output_text


def test_required_tool_choice_and_json_output(client):
    required = create(client, input="Weather in Rome, please.", tools=[WEATHER], tool_choice="required",
                      max_output_tokens=40)
    assert [item.type for item in required.output] == ["function_call"]
    jsonschema.validate(json.loads(required.output[0].arguments), WEATHER["parameters"])
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    shaped = create(client, input="Bob is 30. Give him as JSON.", max_output_tokens=40,
                    text={"format": {"type": "json_schema", "name": "person", "schema": person, "strict": True}})
    jsonschema.validate(json.loads(shaped.output_text), person)
    assert shaped.text.format.type == "json_schema"


def test_logprobs_are_the_chats(client):
    response = create(client, input="Say yes.", max_output_tokens=4, top_logprobs=2,
                      include=["message.output_text.logprobs"])
    chat = chat_text(client, [{"role": "user", "content": "Say yes."}], max_tokens=4, logprobs=True, top_logprobs=2)
    got = response.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 4), len(e.top_logprobs)) for e in got] == \
        [(e.token, round(e.logprob, 4), 2) for e in want]


def test_truncation_auto_drops_the_oldest_turns(client, http):
    long_turns: list[dict[str, Any]] = []
    for i in range(12):
        long_turns += [{"role": "user", "content": f"Tell me fact number {i} about the sea. " * 3},
                       {"role": "assistant", "content": "The sea is large and deep. " * 4}]
    long_turns.append({"role": "user", "content": "One word: hello."})
    refused = http.post("/v1/responses", json={"model": MODEL, "input": long_turns, "max_output_tokens": 8})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input", refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    kept = create(client, input=long_turns, max_output_tokens=8, truncation="auto")
    assert kept.truncation == "auto" and 0 < kept.usage.input_tokens <= CONTEXT - 8
    # What was kept is the longest tail starting at a user turn that fits: the same as sending it.
    fitting = None
    for i in range(0, len(long_turns), 2):
        try:
            fitting = create(client, input=long_turns[i:], max_output_tokens=8, store=False)
            break
        except openai.BadRequestError:
            continue
    assert fitting is not None and i > 0
    assert fitting.usage.input_tokens == kept.usage.input_tokens and fitting.output_text == kept.output_text


@pytest.mark.parametrize("body, param", [
    (dict(input="Hi", tools=[{"type": "web_search"}]), "tools.0.type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
     "input.0.content"),
    (dict(input=[{"type": "reasoning", "summary": []}]), "input.0.type"),
    (dict(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "input.0"),
    (dict(input=[{"type": "function_call_output", "call_id": "c", "output": "x", "role": "user"}]), "input.0"),
    (dict(input=[]), "input"),
    (dict(input="Hi", background=True), "background"),
    (dict(input="Hi", reasoning={"effort": "high"}), "reasoning.effort"),
    (dict(input="Hi", text={"format": {"type": "json_schema", "name": "x"}}), "text.format"),
    (dict(input="Hi", text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}),
     "text.format.schema"),
    (dict(input="Hi", text={"verbosity": "high"}), "text.verbosity"),
    (dict(input="Hi", tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}), "tool_choice.name"),
    (dict(input="Hi", tool_choice="required"), "tool_choice"),
    (dict(input="Hi", max_output_tokens=CONTEXT), "max_output_tokens"),
    (dict(input="Hi", include=["file_search_call.results"]), "include.0"),
    (dict(input="Hi", conversation="conv_1"), "conversation"),
    (dict(input="Hi", frobnicate=1), "frobnicate"),
    (dict(input="Hi", stream_options={"include_obfuscation": False}), "stream_options"),
    (dict(input="Hi", metadata={str(i): "x" for i in range(17)}), "metadata"),
    # A wrong type deep in an item is named where it is, not as input's text alternative.
    (dict(input=[{"role": "user", "content": 5}]), "input.0.content"),
    (dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]), "input.0.arguments"),
    (dict(input=["hi", "there"]), "input.0"),
])
def test_bad_requests_are_400_naming_the_field(http, body, param):
    assert error_of(http, **body)["param"] == param


def test_a_stored_response_is_returned_whole_and_get_takes_no_options(client, http):
    made = create(client, input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(made.id).model_dump() == made.model_dump()
    replay = http.get(f"/v1/responses/{made.id}", params={"stream": "true"})
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"


def test_a_function_call_dumped_by_the_sdk_goes_back_as_it_is(client):
    named = create(client, input="Weather in Oslo?", tools=[WEATHER], max_output_tokens=32,
                   tool_choice={"type": "function", "name": "get_weather"})
    call = named.output[0]
    for dumped in (call.model_dump(), call.model_dump(by_alias=True), call.model_dump(exclude_none=True)):
        again = create(client, tools=[WEATHER], max_output_tokens=4, store=False, input=[
            {"role": "user", "content": "Weather in Oslo?"}, dumped,
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        assert again.status in ("completed", "incomplete")


def test_a_response_past_the_stores_memory_says_it_was_not_stored(app):
    http, state = app
    budget, state.responses.max_bytes = state.responses.max_bytes, 2000
    try:
        reply = http.post("/v1/responses", json={"model": MODEL, "input": "Hi " * 200, "max_output_tokens": 2}).json()
        assert reply["store"] is False and http.get(f"/v1/responses/{reply['id']}").status_code == 404
    finally:
        state.responses.max_bytes = budget


def test_store_refused_where_none_are_kept(app):
    http, state = app
    capacity, state.responses.capacity = state.responses.capacity, 0
    try:
        assert error_of(http, input="Hi", store=True)["param"] == "store"
        kept = len(state.responses)
        unasked = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}).json()
        assert unasked["store"] is False and len(state.responses) == kept  # it says what was done
    finally:
        state.responses.capacity = capacity


def test_the_engine_is_idle_after_all_of_it(app):
    engine = app[1].engine.engine
    kv = engine.scheduler.kv
    assert not engine.has_unfinished_requests and not kv.block_tables
    assert kv.num_free_blocks == kv.num_blocks  # cached blocks are evictable, so free


# --- without the model --------------------------------------------------------------------------------

def _item(text: str) -> ResponseInputItem:
    return ResponseInputItem.model_validate({"role": "user", "content": text})


def _stored(text: str, before: list[ResponseInputItem], extra: str = "") -> StoredResponse:
    output = [{"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": text.upper() + extra, "annotations": [], "logprobs": []}]}]
    return StoredResponse.of({"output": output}, before, [_item(text)])


def test_the_store_keeps_whole_conversations_within_its_count_and_bytes():
    from conveyor.api.errors import APIError

    store = ResponseStore(3, 10**6)
    store.put("a", _stored("one", []))
    store.put("b", _stored("two", store.conversation("a")))
    store.put("c", _stored("three", store.conversation("b")))
    assert [i.text for i in store.conversation("c")] == ["one", "ONE", "two", "TWO", "three", "THREE"]
    # A fourth drops the least recently used ("a"): "c" goes on without it, its conversation whole.
    store.put("d", _stored("four", store.conversation("c")))
    assert store.get("a") is None and len(store) == 3
    assert [i.text for i in store.conversation("d")][:2] == ["one", "ONE"]
    with pytest.raises(APIError) as gone:
        store.conversation("a")
    assert gone.value.param == "previous_response_id" and gone.value.code == "previous_response_not_found"
    # Bytes: a response past the whole budget is not kept, and a large one drops the oldest.
    small = ResponseStore(100, 8192)
    assert small.put("x", _stored("x", []))
    assert not small.put("huge", _stored("y", [], extra="z" * 5000)) and small.get("huge") is None
    assert small.put("big", _stored("y", [], extra="z" * 3000))
    assert small.get("x") is None and small.get("big") is not None and small.size <= 8192
    assert small.delete("big") and small.size == 0 and not small.delete("big")
    assert not ResponseStore(0, 4096).put("a", _stored("one", [])) and not ResponseStore(8, 0).keeps
    # A conversation's items are counted once, however many of its responses are kept: a chain of
    # twenty turns costs what its items do, not twenty times its growing conversation.
    chain = ResponseStore(100, 10**7)
    before: list[ResponseInputItem] = []
    for turn in range(20):
        chain.put(str(turn), _stored(f"turn {turn} " + "x" * 1000, before))
        before = chain.conversation(str(turn))
    bodies = sum(stored.body_bytes for stored in chain._responses.values())
    items = sum(512 + len(item.text) for item in before)
    assert chain.size == bodies + items
    for turn in range(20):
        chain.delete(str(turn))
    assert chain.size == 0 and not chain._holders


class _Detok:
    tokenizer = None


class _FakeGen:
    """A Generation whose one choice writes `pieces` and ends with `finish`, without a model."""

    def __init__(self, pieces: list[str], finish: str = "stop", logprobs: bool = False) -> None:
        self.choices = [Choice(0, _Detok(), 0 if logprobs else None)]  # type: ignore[arg-type]
        self.pieces, self.finish, self.error = pieces, finish, None
        self.prompt_tokens, self.cached_tokens, self.completion_tokens = 5, 0, len(pieces)

    def finished(self) -> "_FakeGen":
        """As after its updates ran (for a whole response)."""
        choice = self.choices[0]
        choice.text, choice.finish_reason = "".join(self.pieces), self.finish
        return self

    async def updates(self):
        from conveyor.api.generation import TokenLogprob

        choice = self.choices[0]
        for n, piece in enumerate(self.pieces):
            choice.text += piece
            if n == len(self.pieces) - 1:
                choice.finish_reason = self.finish
            entries = [TokenLogprob(piece, piece.encode(), -0.5, [], 0)] if choice.num_logprobs is not None else []
            yield choice, piece, entries


def _stream(request: dict[str, Any], gen: _FakeGen) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    import asyncio

    parsed = ResponsesRequest.model_validate({"input": "x", "stream": True, **request})
    chat_tools = parsed.chat_body(parsed.items, "r").get("tools")
    plan = plan_tools(chat_tools, parsed.chat_body(parsed.items, "r").get("tool_choice")) if chat_tools else None
    fmt = ToolCallFormat("m", plan) if plan is not None else ChatFormat("m")
    builder = ResponseBuilder(parsed, "resp_1", "m", 1.0, 1.0, stored=True)
    done: list[dict[str, Any]] = []

    async def run() -> list[str]:
        aborted = lambda: APIError(503, "the server is shutting down")  # noqa: E731
        return [event async for event in builder.events(gen, fmt, done.append, aborted)]  # type: ignore[arg-type]

    return sse_events("".join(asyncio.run(run()))), done


def test_an_aborted_stream_fails_and_is_not_kept():
    events, done = _stream({}, _FakeGen(["Hel", "lo"], finish="abort"))
    assert events[-1]["type"] == "response.failed" and not done
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["status"] == "incomplete"


def test_a_named_calls_logprobs_open_no_message_and_a_cut_call_is_incomplete():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    events, done = _stream({"tools": [tool], "tool_choice": {"type": "function", "name": "f"},
                            "include": ["message.output_text.logprobs"]},
                           _FakeGen(['{"a"', ': 1'], finish="length", logprobs=True))
    (final,) = done
    assert [item["type"] for item in final["output"]] == ["function_call"]
    assert final["status"] == "incomplete" and final["output"][0]["status"] == "incomplete"
    assert "response.output_text.delta" not in [e["type"] for e in events]


def test_auto_tool_calls_stream_as_text_then_a_function_call_item():
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    gen = _FakeGen(["Sure", ". <tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>'])
    events, done = _stream({"tools": [tool]}, gen)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert done == [final]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Sure. "  # the text before the call, as written
    assert json.loads(final["output"][1]["arguments"]) == {"city": "Oslo"} and final["output"][1]["name"] == "get_weather"


def test_a_streamed_auto_call_ends_as_the_whole_response_would():
    """The streamed text before a call is as written, the whole response's as the call parser
    leaves it; the finished response (and what is kept) is the whole one, under the ids streamed."""
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    pieces = ["Sure.  ", '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', " Done."]
    events, done = _stream({"tools": [tool]}, _FakeGen(pieces))
    final = done[0]
    parsed = ResponsesRequest.model_validate({"input": "x", "tools": [tool]})
    fmt = ToolCallFormat("m", plan_tools(parsed.chat_body(parsed.items, "r")["tools"], None))
    whole = ResponseBuilder(parsed, "resp_1", "m", 1.0, 1.0, stored=True).whole(_FakeGen(pieces).finished(), fmt)
    assert [(i["type"], i.get("content"), i.get("arguments")) for i in final["output"]] == \
        [(i["type"], i.get("content"), i.get("arguments")) for i in whole["output"]]
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert [i["id"] for i in final["output"]] == added


def test_a_chat_messages_error_names_the_input_item_it_came_from():
    from conveyor.api.chat_translation import renamed as renamed_by
    from conveyor.api.errors import bad_request
    from conveyor.api.openai_responses import CHAT_FIELDS

    def renamed(error, fields=None):
        return renamed_by(error, CHAT_FIELDS, fields)

    request = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
    earlier = [_item("Hello"), ResponseInputItem.model_validate({"role": "assistant", "content": "Hi."})]
    items = earlier + request.items
    # system, the earlier user and assistant, the user, the assistant's text and call as one, the tool turn
    fields = request.message_fields(items, len(earlier), 0)
    assert fields == {"messages.0": "instructions", "messages.1": "previous_response_id",
                      "messages.2": "previous_response_id", "messages.3": "input.0", "messages.4": "input.1",
                      "messages.4.tool_calls.0": "input.2", "messages.4.tool_calls": "input.2", "messages.5": "input.3"}
    error = renamed(bad_request("messages.4.tool_calls: not rendered", param="messages.4.tool_calls"), fields)
    assert error.param == "input.2" and error.message == "input.2: not rendered"
    assert renamed(bad_request("x", param="messages.4.tool_calls.0.function.name"), fields).param == "input.2"
    assert renamed(bad_request("x", param="messages.4.content"), fields).param == "input.1"
    assert list(request.message_fields(items, len(earlier), 2).values())[1:] == ["input.0", "input.1", "input.2",
                                                                                 "input.2", "input.3"]
    assert renamed(bad_request("x", param="response_format.json_schema.schema")).param == "text.format.schema"
    assert renamed(bad_request("x", param="tools.2.function.parameters")).param == "tools.2.parameters"
