"""Tool-call plumbing without a server: the Hermes/Qwen parser, tool_choice plans, and the
"auto" format's streamed deltas (content until a call may start, the call once whole)."""
from __future__ import annotations

import json

import pytest

from conveyor.api.errors import APIError
from conveyor.api.generation import Choice
from conveyor.api.tools import ToolCallFormat, parse_bare_calls, parse_hermes, plan_tools

TOOL = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_hermes_parser_extracts_calls_and_keeps_the_text_before_them():
    """As vLLM's hermes parser: the content is the text before the first call, as written (so the
    streamed deltas add up to it); text after a call is not content. NaN is not JSON."""
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.'
    content, calls = parse_hermes(text)
    assert content == "Let me check.\n"
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>')[1] == []
    assert parse_hermes('<tool_call>{"name": "", "arguments": {}}</tool_call>')[1] == []
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    unterminated = parse_hermes('<tool_call>{"name": "f", "arguments": {"a": 1}}')[1]
    assert [(c.name, c.arguments) for c in unterminated] == [("f", '{"a": 1}')]


def test_parallel_tool_calls_false_keeps_an_auto_outputs_first_call():
    fmt = ToolCallFormat("m", plan_tools([TOOL], "auto", parallel_tool_calls=False))
    choice = Choice(0, _Detok(), None)  # type: ignore[arg-type]
    choice.text = '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>' \
                  '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>'
    choice.finish_reason = "stop"
    (call,) = fmt.choice_final(choice)["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "A"}
    assert len(fmt.choice_delta(choice, "", None)["delta"]["tool_calls"]) == 1


def test_plans():
    assert plan_tools(None, None) is None
    assert plan_tools([TOOL], None).mode == "auto"
    named = plan_tools([TOOL], {"type": "function", "function": {"name": "get_weather"}})
    assert named.mode == "named" and named.param == "tools.0.function.parameters"
    assert json.loads(named.spec.source)["additionalProperties"] is False  # strict: true closes the object
    required = json.loads(plan_tools([TOOL, TOOL | {"function": {**TOOL["function"], "name": "other"}}],
                                     "required").spec.source)
    assert [v["properties"]["name"] for v in required["anyOf"]] == [{"const": "get_weather"}, {"const": "other"}]
    for tools, choice, param in [(None, "required", "tool_choice"), ([{"type": "x"}], None, "tools.0"),
                                 ([TOOL], "sometimes", "tool_choice"), ([TOOL, TOOL], None, "tools")]:
        with pytest.raises(APIError) as err:
            plan_tools(tools, choice)
        assert err.value.param == param


class _Detok:
    tokenizer = None


def test_auto_stream_holds_back_a_possible_call_and_sends_it_whole():
    fmt = ToolCallFormat("m", plan_tools([TOOL], "auto"))
    choice = Choice(0, _Detok(), None)  # type: ignore[arg-type]
    sent = []
    for piece in ["Sure", ". <tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>']:
        choice.text += piece
        sent.append(fmt.choice_delta(choice, piece, None))
    choice.finish_reason = "stop"
    last = fmt.choice_delta(choice, "", None)
    assert [s["delta"].get("content") for s in sent if s] == ["Sure", ". "]
    assert last["finish_reason"] == "tool_calls" and "stop_reason" in last  # as every other choice has it
    (call,) = last["delta"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    final = fmt.choice_final(choice)
    assert final["message"]["content"] == "Sure. " and final["message"]["tool_calls"][0]["type"] == "function"
    assert final["finish_reason"] == "tool_calls" and final["stop_reason"] is None


@pytest.mark.parametrize(("text", "calls"), [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    ('\n```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Oslo"}\n}\n```\n', [("get_weather", {"city": "Oslo"})]),
    ('```\n{"name": "get_weather", "parameters": {}}\n```', [("get_weather", {})]),
    ('{"name": "get_weather"}', []),  # no arguments: not a call
    ('{"name": "get_weather", "arguments": {}, "parameters": {}}', []),  # both: which?
    ('[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_weather", "arguments": {"city": "B"}}]',
     [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})]),
    ('{"name": "get_time", "arguments": {}}', []),  # not a tool of the request
    ('{"name": "get_weather", "arguments": {}, "id": 1}', []),  # not only a call
    ('{"name": "get_weather", "arguments": "city=Paris"}', []),  # arguments not an object
    ('[{"name": "get_weather", "arguments": {}}, {"a": 1}]', []),  # one item is no call: none is
    ('The call: {"name": "get_weather", "arguments": {}}', []),  # not the whole answer
    ('```python\n{"name": "get_weather", "arguments": {}}\n```', []),
    ('{"name": "get_weather", "arguments": {"x": NaN}}', []),
    ('[]', []),
])
def test_an_answer_that_is_only_calls_is_read_as_calls(text, calls):
    assert [(c.name, json.loads(c.arguments)) for c in parse_bare_calls(text, {"get_weather"})] == calls


def test_auto_stream_holds_back_an_answer_that_may_be_a_bare_call():
    def stream(pieces: list[str]) -> tuple[list[dict], dict]:
        fmt = ToolCallFormat("m", plan_tools([TOOL], "auto"))
        choice = Choice(0, _Detok(), None)  # type: ignore[arg-type]
        sent = []
        for piece in pieces:
            choice.text += piece
            sent.append(fmt.choice_delta(choice, piece, None))
        choice.finish_reason = "stop"
        return [s for s in sent if s], fmt.choice_delta(choice, "", None)

    sent, last = stream(["```json\n", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}', "\n```"])
    assert sent == [] and "content" not in last["delta"] and last["finish_reason"] == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in last["delta"]["tool_calls"]] == [{"city": "Oslo"}]
    # JSON that begins as a call but is none comes out whole at the end, as content.
    sent, last = stream(["{", '"name": ', '"get_time", "arguments": {}}'])
    assert sent == [] and last["delta"]["content"] == '{"name": "get_time", "arguments": {}}'
    assert last["finish_reason"] == "stop"
    # JSON whose first key is no call's goes out from there on; so does a list of anything but objects.
    sent, _ = stream(["{", '"a": ', "1}"])
    assert [s["delta"]["content"] for s in sent] == ['{"a": ', "1}"]
    sent, _ = stream(["[", "1] first"])
    assert [s["delta"]["content"] for s in sent] == ["[1] first"]
    # Anything else streams as it comes, a code fence of another language too.
    sent, _ = stream(["Hello", " there"])
    assert [s["delta"]["content"] for s in sent] == ["Hello", " there"]
    sent, _ = stream(["```py", "thon\nx = 1", "\n```"])
    assert "".join(s["delta"].get("content", "") for s in sent) == "```python\nx = 1\n```"
