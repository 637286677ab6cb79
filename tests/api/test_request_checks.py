"""Requests the front end must refuse with a 400 naming the field (or serve as the field asks),
on an in-process app over an engine with a fake runner and the default model's tokenizer: no
weights, so each check costs milliseconds."""
from __future__ import annotations

import json

from typing import Any, Iterator

import pytest
from fastapi.testclient import TestClient

from conveyor.api.app import ServerState, build_app
from conveyor.api.limits import decode_json
from conveyor.api.metrics import Metrics
from conveyor.config import EngineConfig
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.llm_engine import LLMEngine
from conveyor.sampling.outputs import SamplerOutput
from tests.fakes import FakeRunner

COMPLETIONS, CHAT, TOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize"
MAX_MODEL_LEN = 256

# A template that renders assistant tool calls as Qwen2.5's does (`arguments | tojson`, with the
# call itself when it has no "function"), and each message's content; nothing else of a message.
TOOL_CALLS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}{% if call.function is defined %}{% set call = call.function %}"
    "{% endif %}<tool_call>{{ call.name }} {{ call.arguments | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer() -> Any:
    from conveyor.errors import ModelLoadError
    from conveyor.model.loader import load_tokenizer

    try:
        return load_tokenizer(None)
    except ModelLoadError as exc:
        pytest.skip(str(exc))


class BlockingRunner(FakeRunner):
    """Reports every request whose prompt starts with BLOCKED as left without an allowed token at
    its third output token, as the sampler does when its constraints clash."""

    def execute(self, out: Any, stats: Any) -> SamplerOutput:
        sampled = super().execute(out, stats)
        requests = out.sampling_requests()
        blocked = [i for i, r in enumerate(requests) if r.prompt_token_ids[0] == BLOCKED and len(r.output_token_ids) == 2]
        return SamplerOutput(sampled.tokens, blocked=blocked or None)


BLOCKED = 7


def _client(tokenizer: Any) -> Iterator[TestClient]:
    config = EngineConfig.from_kwargs(max_num_seqs=4)
    engine = LLMEngine(config, BlockingRunner(tokenizer.vocab_size), num_kv_blocks=256, max_model_len=MAX_MODEL_LEN,
                       vocab_size=tokenizer.vocab_size, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids)
    state = ServerState(AsyncEngine(engine), ["m"], Metrics("m"))
    with TestClient(build_app(state)) as http:
        yield http


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    """The default model's tokenizer and chat template (SmolLM2's: it renders role and content only)."""
    yield from _client(_tokenizer())


@pytest.fixture(scope="module")
def tool_http() -> Iterator[TestClient]:
    """The same with a chat template that renders assistant tool calls."""
    tokenizer = _tokenizer()
    tokenizer.set_chat_template(TOOL_CALLS_TEMPLATE)
    yield from _client(tokenizer)


def error_of(response: Any) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# --- the JSON body --------------------------------------------------------------------------------
def test_an_integer_past_pythons_digit_limit_is_invalid_json(http):
    body = b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}"
    error = error_of(http.post(COMPLETIONS, content=body, headers={"content-type": "application/json"}))
    assert error["code"] == "invalid_json" and "digits" in error["message"]
    with pytest.raises(Exception) as caught:
        decode_json(b"[" + b"1" * 4301 + b"]")
    assert getattr(caught.value, "status", None) == 400


# --- chat messages --------------------------------------------------------------------------------
def chat(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": 2, **fields}


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("calls,param", [
    ([{"foo": 1}], "messages.1.tool_calls.0.id"),
    ([{**CALL, "foo": 1}], "messages.1.tool_calls.0.foo"),
    ([{"id": "call_1", "type": "function"}], "messages.1.tool_calls.0.function"),
    ([{**CALL, "function": {"name": "f"}}], "messages.1.tool_calls.0.function.arguments"),
    ([{**CALL, "function": {"name": "f", "arguments": {"a": 1}}}], "messages.1.tool_calls.0.function.arguments"),
    ([{**CALL, "type": "code"}], "messages.1.tool_calls.0.type"),
    ([{k: v for k, v in CALL.items() if k != "id"}], "messages.1.tool_calls.0.id"),
    ([CALL, "call"], "messages.1.tool_calls.1"),
], ids=["the probe's", "unknown key", "no function", "no arguments", "arguments not a string", "type not function", "no id",
        "not an object"])
@pytest.mark.parametrize("path", [CHAT, TOKENIZE])
def test_a_malformed_tool_call_is_a_400_naming_it(tool_http, path, calls, param):
    body = chat([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": calls}])
    if path == TOKENIZE:
        del body["max_tokens"]
    assert error_of(tool_http.post(path, json=body))["param"] == param


def test_a_well_formed_tool_call_is_rendered(tool_http):
    """Its arguments reach the template as the object their JSON text holds (as vLLM and
    llama.cpp pass them): `arguments | tojson` writes them once, not as a quoted string."""
    paris = {**CALL, "function": {"name": "f", "arguments": '{"city": "Paris"}'}}
    not_json = {**CALL, "id": "call_2", "function": {"name": "f", "arguments": "city=Paris"}}
    body = chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [paris]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "42"},
                 {"role": "assistant", "content": None, "tool_calls": [not_json]},
                 {"role": "tool", "tool_call_id": "call_2", "content": "43"}])
    assert tool_http.post(CHAT, json=body).status_code == 200
    del body["max_tokens"]
    tokens = tool_http.post(TOKENIZE, json=body).json()["tokens"]
    prompt = tool_http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '<tool_call>f {"city": "Paris"}</tool_call>' in prompt
    assert '<tool_call>f "city=Paris"</tool_call>' in prompt  # not JSON: written as the text it is


@pytest.mark.parametrize("arguments", ["[" * 100000 + "]" * 100000, '{"a": 1' + "0" * 5000 + "}", "NaN",
                                       '{"x": 1e999}', '"abc"', "null", "[1, 2]"])
def test_tool_call_arguments_that_are_no_json_object_are_rendered_as_their_text(tool_http, arguments):
    """Only a JSON object reaches the template parsed; anything else (too deep, digits past
    Python's limit, NaN, a string) stays the text it is, never a 500."""
    call = {**CALL, "function": {"name": "f", "arguments": arguments}}
    body = chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "42"}])
    del body["max_tokens"]
    reply = tool_http.post(TOKENIZE, json=body)
    assert reply.status_code == 200, reply.text[:300]
    prompt = tool_http.post("/detokenize", json={"tokens": reply.json()["tokens"]}).json()["prompt"]
    assert "<tool_call>f " + json.dumps(arguments) in prompt


def test_a_template_that_fails_on_the_messages_is_a_400_not_a_500():
    from conveyor.model.tokenizer import ChatTemplateError

    tokenizer = _tokenizer()
    tokenizer.set_chat_template("{% for m in messages %}{{ m.missing | tojson }}{% endfor %}")  # Undefined: a TypeError
    with pytest.raises(ChatTemplateError, match="chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


# --- prompt size --------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [[5] * (4 * MAX_MODEL_LEN), [[5] * (4 * MAX_MODEL_LEN), [6] * 3],
                                    "hello " * 100_000], ids=["token ids", "several", "text"])
def test_truncate_prompt_tokens_applies_before_the_size_check(http, prompt):
    body = {"prompt": prompt, "max_tokens": 2, "truncate_prompt_tokens": 100}
    response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    counts = [100, 3] if isinstance(prompt[0], list) else [100]
    assert response.json()["usage"]["prompt_tokens"] == sum(counts)
    too_long = http.post(COMPLETIONS, json={**body, "truncate_prompt_tokens": MAX_MODEL_LEN + 1})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"


def test_truncate_prompt_tokens_applies_before_the_chat_size_check(http):
    body = chat([{"role": "user", "content": "hello " * 100_000}], truncate_prompt_tokens=50)
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 50


# --- logit_bias -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [{"5": 1, "05": 2}, {"05": 1}, {"1_000": 1}, {"+5": 1}, {" 5 ": 1}, {"-1": 1},
                                  {"٥": 1}, {"": 1}, {"9" * 5000: 1}],
                         ids=["same token twice", "leading zero", "underscore", "plus", "spaces", "negative",
                              "non-ASCII digit", "empty", "past int()'s digit limit"])
def test_a_logit_bias_key_that_is_not_a_plain_token_id_is_a_400(http, bias):
    error = error_of(http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1, "logit_bias": bias}))
    assert error["param"] == "logit_bias"


def test_plain_logit_bias_keys_are_taken(http):
    response = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1, "logit_bias": {"0": 1, "1000": -1}})
    assert response.status_code == 200, response.text


# --- structured outputs and tools ---------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"json_schema": {"schema": SCHEMA}}}, "response_format.type"),
    ({"response_format": {"type": None, "json_schema": {"schema": SCHEMA}}}, "response_format.type"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": {"type": "text", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}, "strict": True}},
     "response_format.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "schema_": 1}}},
     "response_format.json_schema.schema_"),
    ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn"),
    ({"structured_outputs": {"json": SCHEMA, "foo": 1}}, "structured_outputs.foo"),
    ({"tools": [{**TOOL, "extra": 1}]}, "tools.0.extra"),
    ({"tools": [{**TOOL, "function": {**TOOL["function"], "params": {}}}]}, "tools.0.function.params"),
    ({"tools": [{**TOOL, "function": {**TOOL["function"], "strict": "false"}}], "tool_choice": "required"},
     "tools.0.function.strict"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}, "x": 1}}, "tool_choice.x"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f", "arguments": "{}"}}},
     "tool_choice.function.arguments"),
], ids=["json_schema without type", "type null", "empty", "text with a schema", "json_object with json_schema",
        "unknown key", "unknown json_schema key", "structured_outputs typo", "structured_outputs extra key",
        "tool key", "function key", "strict not a boolean", "tool_choice key", "tool_choice.function key"])
def test_a_structured_output_or_tool_field_nothing_reads_is_a_400(http, fields, param):
    assert error_of(http.post(CHAT, json=chat([{"role": "user", "content": "x"}], **fields)))["param"] == param


def test_openais_own_structured_output_and_tool_keys_are_read():
    from conveyor.api.protocol import ChatCompletionRequest, parse
    from conveyor.api.structured import requested_grammar
    from conveyor.api.tools import plan_tools
    from conveyor.structured.spec import GrammarSpec

    def grammar(**fields: Any) -> Any:
        return requested_grammar(parse(ChatCompletionRequest, chat([{"role": "user", "content": "x"}], **fields)))

    described = {"name": "n", "description": "d", "schema": SCHEMA, "strict": False}
    assert grammar(response_format={"type": "json_schema", "json_schema": described}) == (
        GrammarSpec.json_schema(SCHEMA), "response_format.json_schema.schema")
    # llama.cpp's server's spelling: a json_object constrained to the schema, not just any object.
    assert grammar(response_format={"type": "json_object", "schema": SCHEMA}) == (
        GrammarSpec.json_schema(SCHEMA), "response_format.schema")
    assert grammar(response_format={"type": "json_object"}) == (GrammarSpec.json_object(), "response_format")
    assert grammar(response_format={"type": "text"}) is None
    tool = {"type": "function", "function": {**TOOL["function"], "description": "d", "strict": True}}
    plan = plan_tools([tool], {"type": "function", "function": {"name": "f"}})
    assert plan is not None and plan.mode == "named" and plan.spec is not None


# --- constraints that leave no token ------------------------------------------------------------------
@pytest.mark.parametrize("fields,param", [
    ({"allowed_token_ids": [28120], "bad_words": ["hello"]}, "allowed_token_ids"),  # 28120 is "hello"
    ({"allowed_token_ids": [2], "min_tokens": 2}, "min_tokens"),  # 2 is EOS
    ({"allowed_token_ids": [5, 6], "stop_token_ids": [5, 6], "min_tokens": 1}, "min_tokens"),
], ids=["bad_words bans the only allowed token", "only EOS before min_tokens", "only stop tokens"])
def test_constraints_that_clash_up_front_are_a_400(http, fields, param):
    body = {"prompt": "Hi", "max_tokens": 3, "temperature": 1, **fields}
    assert error_of(http.post(COMPLETIONS, json=body))["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_left_without_an_allowed_token_ends_with_a_400_and_spares_the_others(http, stream):
    import json
    from concurrent.futures import ThreadPoolExecutor

    plain = {"prompt": [8, 9], "max_tokens": 6, "temperature": 0}
    stuck = {"prompt": [BLOCKED, 9], "max_tokens": 6, "allowed_token_ids": [1, 2, 3], "stream": stream}
    with ThreadPoolExecutor(2) as pool:
        other = pool.submit(http.post, COMPLETIONS, json=plain)
        response = http.post(COMPLETIONS, json=stuck)
        assert other.result().status_code == 200 and other.result().json()["usage"]["completion_tokens"] == 6
    if not stream:
        error = error_of(response)
    else:
        assert response.status_code == 200  # the first tokens went out before the clash
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        assert len([e for e in events if "choices" in e]) == 2
        error = events[-1]["error"]
    assert error["code"] == "no_allowed_token" and error["param"] == "allowed_token_ids"
    assert "output token 3" in error["message"]


# --- min_tokens -----------------------------------------------------------------------------------
def test_a_stop_string_does_not_end_the_output_before_min_tokens(http):
    body = {"prompt": "1, 2, 3, 4,", "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    free = http.post(COMPLETIONS, json=body).json()["choices"][0]
    stop = free["text"][:1]  # in the first token's text, so it would end the output at once
    stopped = http.post(COMPLETIONS, json={**body, "stop": [stop]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and len(stopped["token_ids"]) == 1
    held = http.post(COMPLETIONS, json={**body, "stop": [stop], "min_tokens": 6}).json()
    assert held["usage"]["completion_tokens"] >= 6
    assert held["choices"][0]["token_ids"][:6] == free["token_ids"][:6]


@pytest.mark.parametrize("field,value", [("min_tokens", 5), ("ignore_eos", True)])
@pytest.mark.parametrize("constraint", [{"guided_regex": "a"}, {"response_format": {"type": "json_object"}}])
def test_min_tokens_or_ignore_eos_with_a_grammar_is_a_400(http, field, value, constraint):
    body = chat([{"role": "user", "content": "x"}], max_tokens=8, **{field: value}, **constraint)
    assert error_of(http.post(CHAT, json=body))["param"] == field


# --- message fields the chat template drops ------------------------------------------------------
USER = {"role": "user", "content": "x"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [CALL]}
ANSWER = {"role": "tool", "tool_call_id": "call_1", "content": "42"}


@pytest.mark.parametrize("messages,param", [
    ([{**USER, "name": "ann"}], "messages.0.name"),  # SmolLM2's and Qwen's templates ignore it
    ([USER, {"role": "assistant", "content": "y", "name": "bot"}], "messages.1.name"),
    ([USER, CALLED, ANSWER], "messages.1.tool_calls"),  # SmolLM2's renders no calls
    ([{**USER, "tool_calls": [CALL]}], "messages.0.tool_calls"),
    ([{**USER, "tool_call_id": "call_1"}], "messages.0.tool_call_id"),
    ([USER, CALLED, {"role": "tool", "content": "42"}], "messages.2.tool_call_id"),
], ids=["user name", "assistant name", "tool calls", "tool calls on a user message",
        "tool_call_id on a user message", "tool message without tool_call_id"])
@pytest.mark.parametrize("path", [CHAT, TOKENIZE])
def test_a_message_field_that_cannot_reach_the_model_is_a_400(http, path, messages, param):
    body = {"messages": messages}
    assert error_of(http.post(path, json=body))["param"] == param


def test_message_fields_the_template_renders_are_taken(tool_http):
    # It renders tool calls (and tool turns' content; their tool_call_id links them, as OpenAI requires).
    assert tool_http.post(TOKENIZE, json={"messages": [USER, CALLED, ANSWER]}).status_code == 200
    assert error_of(tool_http.post(TOKENIZE, json={"messages": [{**USER, "name": "ann"}]}))["param"] == \
        "messages.0.name"
    named = "{% for m in messages %}{{ m.get('name', '') }}: {{ m.content }}\n{% endfor %}"
    tokenizer = _tokenizer()
    tokenizer.set_chat_template(named)
    for http in _client(tokenizer):
        response = http.post(TOKENIZE, json={"messages": [{**USER, "name": "ann"}, {**USER, "name": "bob"}]})
        assert response.status_code == 200, response.text


def test_a_served_model_can_be_retrieved_by_name(http):
    listed = http.get("/v1/models").json()["data"][0]
    assert http.get("/v1/models/m").json() == listed
    missing = http.get("/v1/models/gpt-17")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_chat_and_its_tokenize_count_one_bos_where_the_template_writes_it():
    """A model that adds BOS, with a template that writes it too (Gemma's, Llama 3's): the prompt
    holds one, as llama.cpp's server renders it; a client's add_special_tokens true gets a second."""
    from tests.model.test_tokenizer import _tiny_sentencepiece

    tokenizer, ids = _tiny_sentencepiece()
    for http in _client(tokenizer):
        messages = [{"role": "user", "content": "ab"}]
        served = http.post(CHAT, json=chat(messages))
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["prompt_tokens"] == 2
        assert http.post(TOKENIZE, json={"messages": messages}).json()["tokens"] == [ids["<bos>"], ids["ab"]]
        doubled = http.post(TOKENIZE, json={"messages": messages, "add_special_tokens": True}).json()["tokens"]
        assert doubled == [ids["<bos>"], ids["<bos>"], ids["ab"]]


@pytest.mark.parametrize("stream", [False, True])
def test_the_stop_token_counts_but_its_text_is_left_out_unless_asked(http, stream):
    """vLLM's: the EOS or stop_token_ids entry that ends an output is one of its tokens (usage,
    token_ids), but its text is not part of the output unless include_stop_str_in_output."""
    import json

    tokenizer = _tokenizer()
    body = {"prompt": [5, 6], "max_tokens": 6, "return_token_ids": True, "stream": stream}
    free = http.post(COMPLETIONS, json={**body, "stream": False}).json()["choices"][0]["token_ids"]
    stop = free[1]
    assert tokenizer.decode([stop]), "the test needs a stop token with text"

    def served(**fields: Any) -> tuple[str, list[int], str]:
        response = http.post(COMPLETIONS, json={**body, "stop_token_ids": [stop], **fields})
        assert response.status_code == 200, response.text
        if not stream:
            choice = response.json()["choices"][0]
            return choice["text"], choice["token_ids"], choice["finish_reason"]
        chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        choices = [c["choices"][0] for c in chunks if c.get("choices")]
        ids = [t for c in choices for t in c.get("token_ids") or []]
        return "".join(c["text"] for c in choices), ids, choices[-1]["finish_reason"]

    text, ids, reason = served()
    assert (ids, reason) == ([free[0], stop], "stop")
    assert text == tokenizer.decode([free[0]])
    text, ids, _ = served(include_stop_str_in_output=True)
    assert ids == [free[0], stop] and text == tokenizer.decode([free[0], stop])


def test_a_browser_page_may_call_the_api_from_the_origins_allowed():
    """CORS as vLLM's --allowed-origins (default any): the preflight is answered without the API
    key (a browser sends none with it), and answers, errors included, carry the header."""
    tokenizer = _tokenizer()
    preflight = {"Origin": "http://page.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    for origins, allowed in ((("*",), "*"), (("http://page.example",), "http://page.example"), ((), None)):
        config = EngineConfig.from_kwargs(max_num_seqs=4)
        engine = LLMEngine(config, FakeRunner(tokenizer.vocab_size), num_kv_blocks=64, max_model_len=MAX_MODEL_LEN,
                           vocab_size=tokenizer.vocab_size, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids)
        state = ServerState(AsyncEngine(engine), ["m"], Metrics("m"), api_key="k", allowed_origins=origins)
        with TestClient(build_app(state)) as http:
            answer = http.options(COMPLETIONS, headers=preflight)
            assert answer.headers.get("access-control-allow-origin") == allowed
            if allowed is not None:
                assert answer.status_code == 200 and "authorization" in answer.headers["access-control-allow-headers"]
            origin = {"Origin": "http://page.example"}
            keyed = {**origin, "Authorization": "Bearer k"}
            served = http.post(COMPLETIONS, json={"prompt": [5], "max_tokens": 2}, headers=keyed)
            refused = http.post(COMPLETIONS, json={"prompt": [5], "max_tokens": 0}, headers=keyed)
            unauthorized = http.post(COMPLETIONS, json={"prompt": [5], "max_tokens": 2}, headers=origin)
            assert (served.status_code, refused.status_code, unauthorized.status_code) == (200, 400, 401)
            for response in (served, refused, unauthorized):
                assert response.headers.get("access-control-allow-origin") == allowed


def test_tools_the_template_cannot_show_are_refused_with_tool_choice_none(http):
    """SmolLM2's template renders no tools: sent beside tool_choice 'none' they would be dropped."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = chat([{"role": "user", "content": "Hi"}], tools=tools, tool_choice="none")
    assert error_of(http.post(CHAT, json=body))["param"] == "tools"
    assert http.post(CHAT, json={**body, "tools": []}).status_code == 200
    shows_tools = _tokenizer()
    shows_tools.set_chat_template("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
                                  "{{ m.content }}{% endfor %}")
    for client in _client(shows_tools):
        assert client.post(CHAT, json=body).status_code == 200


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "def f():", "suffix": "\nf()"}, "suffix"),  # SmolLM2 has no infill tokens
    ({"prompt": [1, 2, 3], "suffix": "\nf()"}, "suffix"),  # the code before the middle must be text
    ({"prompt": [[1, 2], [3]], "suffix": "\nf()"}, "suffix"),
    ({"prompt": "def f():", "suffix": "\nf()", "echo": True}, "echo"),
])
def test_a_suffix_the_model_or_the_request_cannot_take_is_a_400(http, fields, param):
    assert error_of(http.post(COMPLETIONS, json={"max_tokens": 2, **fields}))["param"] == param


def test_a_prompt_that_fits_alone_is_refused_untokenized_with_its_suffix(http):
    prompt = http.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    limit = prompt["anyOf"][0]["maxLength"]  # the most characters a text prompt may have
    error = error_of(http.post(COMPLETIONS, json={"prompt": "x" * (limit - 1), "suffix": "yz", "max_tokens": 2}))
    assert error["param"] == "prompt" and error["message"].startswith("the prompt and suffix"), error


def test_the_schema_states_that_this_model_takes_no_suffix(http):
    suffix = http.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["suffix"]
    assert [alt.get("maxLength") for alt in suffix["anyOf"] if alt.get("type") == "string"] == [0], suffix


def test_an_empty_suffix_is_a_plain_completion(http):
    reply = http.post(COMPLETIONS, json={"prompt": "def f():", "suffix": "", "max_tokens": 2})
    assert reply.status_code == 200, reply.text
