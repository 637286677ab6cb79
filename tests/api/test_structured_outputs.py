"""Structured outputs and tool calls through the official openai client on the real model:
a table of JSON schemas (each output validated with jsonschema), regex, choice, an EBNF grammar,
vLLM's field spellings, named and "required" tool calls, streaming equal to non-streaming, and the
400s that name the offending field. Greedy and short; the table goes in concurrently (one batch)."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.api.conftest import MODEL

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
SHORT = {"type": "string", "maxLength": 16}

SCHEMAS: list[tuple[str, dict]] = [
    ("a person", PERSON),
    ("a city and its country", {"type": "object", "properties": {"city": SHORT, "country": SHORT},
                                "required": ["city", "country"]}),
    ("a boolean answer", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("a colour", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("a temperature", {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
                       "required": ["celsius"]}),
    ("a percentage", {"type": "object", "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 100}},
                      "required": ["value"]}),
    ("three fruits", {"type": "object", "properties": {"fruits": {"type": "array", "items": SHORT,
                                                                  "minItems": 3, "maxItems": 3}},
                      "required": ["fruits"]}),
    ("a list of numbers", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                           "minItems": 1, "maxItems": 5}),
    ("a nested address", {"type": "object", "properties": {
        "name": SHORT, "address": {"type": "object", "properties": {"street": SHORT, "zip": {"type": "string",
                                                                                              "pattern": "^[0-9]{5}$"}},
                                   "required": ["street", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}),
    ("a book", {"type": "object", "properties": {"title": SHORT, "year": {"type": "integer", "minimum": 1450,
                                                                             "maximum": 2030},
                                                  "genre": {"enum": ["fiction", "science", "history"]}},
                "required": ["title", "year", "genre"]}),
    ("a point", {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                 "required": ["x", "y"], "additionalProperties": False}),
    ("optional fields", {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                          "note": SHORT}, "required": ["id"],
                         "additionalProperties": False}),
    ("a $ref", {"$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "name": SHORT},
                                  "required": ["kind", "name"]}},
                "type": "object", "properties": {"pet": {"$ref": "#/$defs/pet"}}, "required": ["pet"]}),
    ("a $ref list", {"definitions": {"item": {"type": "object", "properties": {"sku": {"type": "string",
                                                                                        "pattern": "^[A-Z]{3}$"},
                                                                                "qty": {"type": "integer",
                                                                                        "minimum": 1, "maximum": 9}},
                                              "required": ["sku", "qty"]}},
                     "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/definitions/item"},
                                                              "minItems": 1, "maxItems": 2}},
                     "required": ["items"]}),
    ("an enum of numbers", {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"]}),
    ("a const", {"type": "object", "properties": {"version": {"const": "v1"}, "ok": {"type": "boolean"}},
                 "required": ["version", "ok"]}),
    ("a date", {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
                "required": ["date"]}),
    ("a rating", {"type": "object", "properties": {"stars": {"type": "number", "minimum": 1, "maximum": 5},
                                                   "comment": SHORT}, "required": ["stars", "comment"]}),
    ("a union", {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50},
                                                                      {"type": "boolean"}]}},
                 "required": ["value"]}),
    ("a nullable", {"type": "object", "properties": {"middle_name": {"type": ["string", "null"], "maxLength": 12}},
                    "required": ["middle_name"]}),
    ("a matrix", {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                             "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}),
    ("a team", {"type": "object", "properties": {"team": SHORT, "members": {"type": "array", "items": PERSON,
                                                                            "minItems": 1, "maxItems": 2}},
                "required": ["team", "members"]}),
    ("an order", {"type": "object", "properties": {
        "order_id": {"type": "integer", "minimum": 1000, "maximum": 9999},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "total": {"type": "number", "minimum": 0, "maximum": 1000}},
        "required": ["order_id", "status", "total"], "additionalProperties": False}),
    ("a sentiment", {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
                     "required": ["label", "score"]}),
    ("a string", {"type": "string", "maxLength": 24}),
    ("an integer", {"type": "integer", "minimum": 10, "maximum": 20}),
    ("a boolean", {"type": "boolean"}),
    ("a tagged list", {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                                 "maxItems": 3}},
                       "required": ["tags"]}),
    ("a $ref chain", {"$defs": {"grade": {"enum": ["A", "B", "C"]},
                                "student": {"type": "object", "properties": {"name": SHORT,
                                                                             "grade": {"$ref": "#/$defs/grade"}},
                                            "required": ["name", "grade"]}},
                      "$ref": "#/$defs/student"}),
    ("a weather report", {"type": "object", "properties": {
        "city": SHORT, "forecast": {"type": "array", "items": {"type": "object", "properties": {
            "day": {"enum": ["mon", "tue", "wed"]}, "high": {"type": "integer", "minimum": -20, "maximum": 45}},
            "required": ["day", "high"], "additionalProperties": False}, "minItems": 1, "maxItems": 2}},
        "required": ["city", "forecast"]}),
    ("an exclusive bound", {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0,
                                                                   "exclusiveMaximum": 10}}, "required": ["n"]}),
    ("an email-ish", {"type": "object", "properties": {"email": {"type": "string",
                                                                 "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
                      "required": ["email"]}),
]


def chat(client, content: str, **kwargs):  # noqa: ANN001, ANN003, ANN201
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=0, **kwargs)


def test_json_schema_table_validates(server):
    assert len(SCHEMAS) >= 30
    # 32 requests in one batch: on a loaded 2-core machine that can outlast the shared client's timeout.
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=600.0)

    def one(case: tuple[str, dict]) -> tuple[str, dict, object]:
        what, schema = case
        reply = chat(client, f"Describe {what} as JSON.", max_tokens=96,
                     response_format={"type": "json_schema",
                                      "json_schema": {"name": "answer", "schema": schema, "strict": True}})
        return what, schema, reply.choices[0]

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(one, SCHEMAS))
    for what, schema, choice in results:
        assert choice.finish_reason == "stop", (what, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_regex_choice_and_grammar_in_every_spelling(client):
    phone = r"\d{3}-\d{4}"
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    cases = [
        ("json_object", dict(response_format={"type": "json_object"}), lambda t: isinstance(json.loads(t), dict)),
        ("regex", dict(extra_body={"structured_outputs": {"regex": phone}}), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        ("guided_regex", dict(extra_body={"guided_regex": phone}), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        ("choice", dict(extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}}),
         lambda t: t in ("yes", "no", "maybe")),
        ("guided_choice", dict(extra_body={"guided_choice": ["Paris", "London"]}), lambda t: t in ("Paris", "London")),
        ("grammar", dict(extra_body={"structured_outputs": {"grammar": grammar}}),
         lambda t: t in ("The answer is yes.", "The answer is no.")),
        ("guided_grammar", dict(extra_body={"guided_grammar": grammar}),
         lambda t: t in ("The answer is yes.", "The answer is no.")),
        ("guided_json", dict(extra_body={"guided_json": PERSON}), lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ("structured json", dict(extra_body={"structured_outputs": {"json": PERSON}}),
         lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ]

    def one(case):  # noqa: ANN001, ANN202
        name, kwargs, _ = case
        return chat(client, "What is the capital of France? Give a phone number too.", max_tokens=48, **kwargs)

    with ThreadPoolExecutor(len(cases)) as pool:
        replies = list(pool.map(one, cases))
    for (name, _, check), reply in zip(cases, replies):
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop" and check(text), (name, text)

    # On /v1/completions too, with vLLM's field.
    out = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": [" yes", " no"]})
    assert out.choices[0].text in (" yes", " no") and out.choices[0].finish_reason == "stop"


def test_streaming_equals_non_streaming(client):
    kwargs = dict(max_tokens=96, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    full = chat(client, "Describe a person as JSON.", **kwargs).choices[0]
    chunks = list(chat(client, "Describe a person as JSON.", stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.finish_reason == "stop"
    done = client.completions.create(model=MODEL, prompt="A person:", max_tokens=64, temperature=0,
                                     extra_body={"guided_json": PERSON})
    streamed = client.completions.create(model=MODEL, prompt="A person:", max_tokens=64, temperature=0,
                                         extra_body={"guided_json": PERSON}, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}


def test_named_and_required_tool_calls(client):
    ask = "What is the weather in Paris?"
    named = chat(client, ask, max_tokens=64, tools=[WEATHER, TIME],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert named.finish_reason == "tool_calls" and named.message.content is None
    (call,) = named.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    required = chat(client, ask, max_tokens=64, tools=[WEATHER, TIME], tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls"
    (call,) = required.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

    # Streamed: the arguments arrive as deltas of one call and add up to the whole call.
    chunks = list(chat(client, ask, max_tokens=64, tools=[WEATHER], stream=True,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 1
    assert "".join(d.function.arguments or "" for d in deltas) == named.message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    streamed_required = list(chat(client, ask, max_tokens=64, tools=[WEATHER, TIME], tool_choice="required",
                                  stream=True))
    calls = [d for c in streamed_required if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in calls] == [
        (c.function.name, c.function.arguments) for c in required.message.tool_calls]

    # SmolLM2's template renders no tools: beside tool_choice "none" they could not reach the model.
    with pytest.raises(openai.BadRequestError) as unseen:
        chat(client, ask, max_tokens=8, tools=[WEATHER], tool_choice="none")
    assert unseen.value.body["param"] == "tools"
    plain = chat(client, ask, max_tokens=8, tool_choice="none").choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason in ("stop", "length")


@pytest.mark.parametrize("kwargs, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema.schema"),
    (dict(response_format={"type": "yaml"}), "response_format.type"),
    (dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs.regex"),
    (dict(extra_body={"guided_regex": "[a-"}), "guided_regex"),
    (dict(extra_body={"guided_grammar": "root ::= missing_rule"}), "guided_grammar"),
    (dict(extra_body={"guided_choice": []}), "guided_choice"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"structural_tag": "x"}}), "structured_outputs.structural_tag"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name"),
    (dict(tools=[WEATHER]), "tool_choice"),  # "auto" by default, and SmolLM2's template renders no tools
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
          tool_choice="required"), "tools"),
])
def test_bad_constraints_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, "Hi", max_tokens=4, **kwargs)
    assert err.value.body["param"] == param, err.value.body
