"""Ollama's API (/api/chat, /api/generate, /api/embed, /api/tags, ...) through Ollama's own Python
client on the real Qwen2.5-Coder-0.5B-Instruct, in-process over the real engine: the same text as the
chat or completion each request amounts to, streamed lines that add up to the whole answer, token
counts and durations, `context` kept across /api/generate calls, fill-in-the-middle, tool calls,
embeddings, the model list, and refusals in Ollama's envelope naming the field at fault."""
from __future__ import annotations

import datetime
import json
import math
from typing import Any

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient

from tests.api import coder_app
from tests.api.coder_app import MODEL

app, http = coder_app.app, coder_app.http  # the real model's app, one for this module

ollama = pytest.importorskip("ollama")

GREEDY = {"temperature": 0}
# Keys in the order Ollama's client sends them (its Tool type's), which a template's tojson keeps.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "The city"}}}}}


class _Through(httpx.BaseTransport):
    """Ollama's client speaks httpx; the app's TestClient is another client library: each request
    is handed over whole, and the reply handed back."""

    def __init__(self, http: TestClient) -> None:
        self.http = http

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        reply = self.http.request(request.method, request.url.path, content=request.read(),
                                  headers={k: v for k, v in request.headers.items() if k.lower() != "host"})
        return httpx.Response(reply.status_code, headers=dict(reply.headers), content=reply.content)


@pytest.fixture(scope="module")
def client(http: TestClient) -> Any:
    return ollama.Client(host="http://testserver", transport=_Through(http))


def chat(http: TestClient, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "temperature": 0, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def durations_hold(answer: Any) -> None:
    assert answer.done is True and answer.load_duration == 0
    assert 0 < answer.prompt_eval_duration and 0 <= answer.eval_duration
    assert answer.prompt_eval_duration + answer.eval_duration <= answer.total_duration
    assert datetime.datetime.fromisoformat(answer.created_at).tzinfo is not None


QUESTION = [{"role": "user", "content": "What is a Python tuple? One sentence."}]


def test_a_chat_is_the_chat_completion_it_amounts_to(client, http):
    answer = client.chat(model=MODEL, messages=QUESTION, options={**GREEDY, "num_predict": 24}, stream=False)
    same = chat(http, QUESTION, max_tokens=24)
    choice = same["choices"][0]
    assert answer.message.role == "assistant" and answer.message.content == choice["message"]["content"]
    assert answer.done_reason == choice["finish_reason"] == "length"
    usage = same["usage"]
    assert answer.eval_count == usage["completion_tokens"] == 24
    # The whole prompt, those tokens the prefix cache held (here, from the request before) too.
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert answer.prompt_eval_count == usage["prompt_tokens"]
    assert answer.model == MODEL
    durations_hold(answer)


def test_streamed_lines_add_up_to_the_whole_answer(client, http):
    ask = dict(messages=QUESTION, options={**GREEDY, "num_predict": 20})
    whole = client.chat(model=MODEL, stream=False, **ask)
    lines = list(client.chat(model=f"{MODEL}:latest", stream=True, **ask))  # Ollama's default tag is taken
    assert all(not line.done for line in lines[:-1]) and lines[-1].done
    assert "".join(line.message.content for line in lines) == whole.message.content
    assert lines[-1].model == f"{MODEL}:latest" and lines[-1].eval_count == 20 and lines[-1].done_reason == "length"
    durations_hold(lines[-1])
    raw = http.post("/api/chat", json={"model": MODEL, "messages": QUESTION, "options": {**GREEDY, "num_predict": 4}})
    assert raw.headers["content-type"].startswith("application/x-ndjson")  # streamed unless told not to
    assert len([json.loads(line) for line in raw.text.splitlines()]) == 5


def test_options_are_the_sampling_fields_they_name(client, http):
    options = {"temperature": 0.9, "top_k": 20, "top_p": 0.8, "min_p": 0.05, "seed": 7, "num_predict": 16,
               "repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.3, "stop": ["\n\n"]}
    answer = client.chat(model=MODEL, messages=QUESTION, options=options, stream=False)
    same = chat(http, QUESTION, temperature=0.9, top_k=20, top_p=0.8, min_p=0.05, seed=7, max_tokens=16,
                repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3, stop=["\n\n"])
    assert answer.message.content == same["choices"][0]["message"]["content"]
    # top_k 0 is the whole vocabulary (llama.cpp's), num_predict -1 until the context is full.
    assert client.chat(model=MODEL, messages=QUESTION, options={"top_k": 0, "num_predict": -1, **GREEDY},
                       stream=False).done_reason == "stop"


def test_num_ctx_bounds_the_prompt_and_the_output(client, http):
    prompt_tokens = chat(http, QUESTION, max_tokens=1)["usage"]["prompt_tokens"]
    answer = client.chat(model=MODEL, messages=QUESTION, options={**GREEDY, "num_ctx": prompt_tokens + 5}, stream=False)
    assert answer.eval_count == 5 and answer.done_reason == "length"
    capped = client.chat(model=MODEL, messages=QUESTION, options={**GREEDY, "num_ctx": prompt_tokens + 5,
                                                                  "num_predict": 50}, stream=False)
    assert capped.eval_count == 5


def test_generate_is_a_chat_of_one_turn_and_keeps_its_context(client, http):
    answer = client.generate(model=MODEL, prompt="Name a sorting algorithm.", system="Answer in three words.",
                             options={**GREEDY, "num_predict": 12})
    messages = [{"role": "system", "content": "Answer in three words."},
                {"role": "user", "content": "Name a sorting algorithm."}]
    same = chat(http, messages, max_tokens=12, return_token_ids=True)
    assert answer.response == same["choices"][0]["message"]["content"]
    # Its context: the prompt's tokens, then the answer's, to send with the next request.
    assert list(answer.context) == same["prompt_token_ids"] + same["choices"][0]["token_ids"]
    durations_hold(answer)
    more = client.generate(model=MODEL, prompt="And another one?", context=answer.context,
                           options={**GREEDY, "num_predict": 12})
    turn = http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "And another one?"}]})
    assert more.context[: len(answer.context)] == answer.context
    assert len(more.context) == len(answer.context) + turn.json()["count"] + more.eval_count


def test_raw_and_suffix_are_completions(client, http):
    raw = client.generate(model=MODEL, prompt="def fibonacci(n):", raw=True, options={**GREEDY, "num_predict": 24})
    same = http.post("/v1/completions", json={"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 24,
                                              "temperature": 0}).json()
    assert raw.response == same["choices"][0]["text"] and raw.context is None
    middle = client.generate(model=MODEL, prompt="def add(a, b):\n", suffix="\n\nprint(add(1, 2))\n",
                             options={**GREEDY, "num_predict": 24})
    fim = http.post("/v1/completions", json={"model": MODEL, "prompt": "def add(a, b):\n",
                                             "suffix": "\n\nprint(add(1, 2))\n", "max_tokens": 24,
                                             "temperature": 0}).json()
    assert middle.response == fim["choices"][0]["text"] and "return" in middle.response


def test_null_options_are_options_not_sent(http):
    """LangChain's Ollama clients send every option, most of them null."""
    nulls = {name: None for name in ("num_gpu", "num_thread", "mirostat", "tfs_z", "repeat_last_n", "temperature")}
    answer = http.post("/api/chat", json={"model": MODEL, "messages": QUESTION, "stream": False,
                                          "options": {**nulls, "num_predict": 4}}).json()
    assert answer["eval_count"] == 4
    embedded = http.post("/api/embed", json={"model": MODEL, "input": "x", "options": nulls})
    assert embedded.status_code == 200 and len(embedded.json()["embeddings"]) == 1


def test_heartbeat_and_version(http):
    assert http.head("/").status_code == 200 and http.get("/").status_code == 200
    version = http.get("/api/version").json()
    assert tuple(int(n) for n in version["version"].split(".")) >= (0, 5, 0)  # what clients gate schema formats on
    assert version["conveyor_version"]


def test_an_empty_request_answers_loaded(client):
    assert client.generate(model=MODEL).done_reason == "load"
    assert client.chat(model=MODEL, messages=[]).done_reason == "load"


def test_tool_calls_and_their_results(client, http):
    ask = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    answer = client.chat(model=MODEL, messages=ask, tools=[WEATHER], options=GREEDY, stream=False)
    assert answer.message.content == ""
    [call] = answer.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    # The same call as the chat completion gives it (the answer is a bare JSON call, no tags).
    same = chat(http, ask, tools=[WEATHER])["choices"][0]
    assert same["finish_reason"] == "tool_calls"
    assert json.loads(same["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    streamed = list(client.chat(model=MODEL, messages=ask, tools=[WEATHER], options=GREEDY, stream=True))
    assert [c.function.arguments for line in streamed for c in line.message.tool_calls or []] == [{"city": "Paris"}]
    assert "".join(line.message.content for line in streamed) == ""
    # The result sent back, as Ollama's clients send it (the tool named, no call id): the same prompt
    # as the chat's with the call's id.
    history = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "18 C, sunny"}]
    after = client.chat(model=MODEL, messages=history, tools=[WEATHER], options={**GREEDY, "num_predict": 24},
                        stream=False)
    as_chat = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": "18 C, sunny"}]
    same_after = chat(http, as_chat, tools=[WEATHER], max_tokens=24)
    assert after.message.content == same_after["choices"][0]["message"]["content"]
    assert after.prompt_eval_count == same_after["usage"]["prompt_tokens"]
    # Clients that keep call ids send them (and content null on the call's turn): the same prompt.
    with_ids = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "18 C, sunny"}]
    by_id = http.post("/api/chat", json={"model": MODEL, "messages": with_ids, "tools": [WEATHER], "stream": False,
                                         "options": {**GREEDY, "num_predict": 24}}).json()
    assert by_id["message"]["content"] == after.message.content


def test_json_format_and_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    answer = client.chat(model=MODEL, messages=[{"role": "user", "content": "Alice is 30. Reply in JSON."}],
                         format=schema, options=GREEDY, stream=False)
    jsonschema.validate(json.loads(answer.message.content), schema)
    loose = client.generate(model=MODEL, prompt="Give a JSON object with a key 'x'.", format="json",
                            options={**GREEDY, "num_predict": 40})
    assert isinstance(json.loads(loose.response), dict)


def test_logprobs(http):
    lines = [json.loads(line) for line in http.post("/api/chat", json={
        "model": MODEL, "messages": QUESTION, "options": {**GREEDY, "num_predict": 3}, "logprobs": True,
        "top_logprobs": 2}).text.splitlines()]
    tokens = [entry for line in lines for entry in line.get("logprobs", [])]
    assert len(tokens) == 3 and "".join(t["token"] for t in tokens) == "".join(line["message"]["content"] for line in lines)
    assert all(len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["token"] == t["token"] for t in tokens)


def test_embeddings(client, http):
    texts = ["def add(a, b): return a + b", "a recipe for bread"]
    answer = client.embed(model=MODEL, input=texts)
    same = http.post("/v1/embeddings", json={"model": MODEL, "input": texts}).json()
    assert answer.embeddings == [d["embedding"] for d in same["data"]]
    assert answer.prompt_eval_count == same["usage"]["prompt_tokens"]
    legacy = client.embeddings(model=MODEL, prompt=texts[0]).embedding  # not normalized, as Ollama's
    norm = math.sqrt(sum(v * v for v in legacy))
    assert abs(norm - 1) > 1e-3
    assert max(abs(a / norm - b) for a, b in zip(legacy, answer.embeddings[0])) < 1e-4
    long = "word " * 600  # past the 512-token context: truncated from its end by default, as Ollama
    assert len(client.embed(model=MODEL, input=long).embeddings[0]) == 896
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model=MODEL, input=long, truncate=False)
    assert refused.value.status_code == 400 and "input" in refused.value.error


def test_model_list_show_and_running(client, app):
    _, state = app
    facts = state.engine.model_facts
    [listed] = client.list().models
    assert listed.model == MODEL and listed.size == facts.size_bytes and len(listed.digest) == 64
    assert (listed.details.format, listed.details.family, listed.details.quantization_level) == ("gguf", "qwen2", "Q4_K_M")
    shown = client.show(MODEL)
    assert {"completion", "tools", "insert"} <= set(shown.capabilities)
    assert "<tool_call>" in shown.template and shown.modelinfo["general.architecture"] == "qwen2"
    assert shown.modelinfo["qwen2.embedding_length"] == 896
    [running] = client.ps().models
    assert running.context_length == state.capacity
    assert client.pull(MODEL).status == "success"
    with pytest.raises(ollama.ResponseError) as refused:
        client.pull("llama3.2")
    assert refused.value.status_code == 404 and "downloads no model" in refused.value.error


REFUSALS = [
    ("/api/chat", {"options": {"num_gpu": 1}}, "options.num_gpu"),
    ("/api/chat", {"options": {"num_thread": 4}}, "--threads"),
    ("/api/chat", {"options": {"mirostat": 2}}, "options.mirostat"),
    ("/api/chat", {"options": {"repeat_last_n": 64}}, "options.repeat_last_n"),
    ("/api/chat", {"options": {"temperature": 3}}, "options.temperature"),
    ("/api/chat", {"options": {"num_ctx": 100000}}, "options.num_ctx"),
    ("/api/chat", {"options": {"num_ctx": 8}}, "options.num_ctx"),
    ("/api/chat", {"options": {"bogus": 1}}, "options.bogus"),
    ("/api/chat", {"keep_alive": 0}, "keep_alive"),
    ("/api/chat", {"keep_alive": "soon"}, "keep_alive"),
    ("/api/chat", {"think": True}, "think"),
    ("/api/chat", {"format": "yaml"}, "format"),
    ("/api/chat", {"top_logprobs": 2}, "top_logprobs"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "images"),
    ("/api/chat", {"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ("/api/chat", {"model": "llama3.2"}, "llama3.2"),
    ("/api/generate", {"template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"suffix": "x", "raw": True}, "suffix"),
    ("/api/generate", {"context": [10**9]}, "context"),
    ("/api/generate", {"options": {"stop": 5}}, "options.stop"),
    ("/api/embed", {"input": "x", "options": {"temperature": 0}}, "temperature"),
    ("/api/show", {"verbose": True}, "verbose"),
    ("/api/pull", {"model": None}, "model"),
    ("/api/pull", {"insecure": True}, "insecure"),
]


@pytest.mark.parametrize(("path", "fields", "named"), REFUSALS)
def test_refusals_name_the_field_in_ollamas_envelope(http, path, fields, named):
    asks = {"/api/chat": {"messages": QUESTION}, "/api/generate": {"prompt": "x"}}.get(path, {})
    body = {"model": MODEL, **({"stream": False} if path in ("/api/chat", "/api/generate") else {}), **asks, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    reply = http.post(path, json=body)
    assert reply.status_code in (400, 404), reply.text
    assert set(reply.json()) == {"error"} and named in reply.json()["error"]


def test_a_tool_turn_is_matched_to_its_call():
    from conveyor.api.ollama import OllamaChatRequest

    def ids(messages: list[dict[str, Any]]) -> list[str | None]:
        turns = OllamaChatRequest.model_validate({"model": MODEL, "messages": messages}).chat_messages()
        return [turn.get("tool_call_id") for turn in turns if turn["role"] == "tool"]

    calls = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "a", "arguments": {}}}, {"id": "b1", "function": {"name": "b", "arguments": {}}}]}
    # By id where it names a call, else by the tool's name, else the earliest call unanswered.
    assert ids([calls, {"role": "tool", "tool_call_id": "b1", "content": "1"},
                {"role": "tool", "tool_name": "a", "content": "2"}]) == ["b1", "call_0_0"]
    assert ids([calls, {"role": "tool", "tool_call_id": "zzz", "tool_name": "b", "content": "1"},
                {"role": "tool", "content": "2"}]) == ["b1", "call_0_0"]
