"""Tool calls on /v1/chat/completions: `tools` with `tool_choice`.

- A named function (`{"type": "function", "function": {"name": ...}}`) constrains the output to
  that function's parameter schema; the output is the call's `arguments` (as vLLM does).
- `"required"` constrains it to `{"name": <one of the tools>, "arguments": <its parameters>}`.
- `"auto"` (the default when tools are given) lets the model choose, and needs a chat template
  that renders the tools (the model's own, or `conveyor serve --chat-template FILE`); calls in the
  Hermes/Qwen format `<tool_call>{"name": ..., "arguments": ...}</tool_call>` are parsed out of the
  text, and so is an answer that is nothing but such an object (or a list of them), bare or in a
  ```json fence, naming a tool of the request: small Qwen2.5 models answer so, without the tags
  their template asks for. A template that ignores the tools is a 400, as vLLM refuses "auto"
  without a tool parser.
- `"none"` renders the tools (if the template does) and constrains nothing.

Calls come back as `tool_calls` (id, type "function", function.name, function.arguments as a
JSON string) with finish_reason "tool_calls"; streamed, a named call's arguments go out as deltas
as they are generated, the others in one delta once the call is complete.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from conveyor.api.errors import bad_request
from conveyor.api.generation import Choice, TokenLogprob
from conveyor.api.limits import strict_json
from conveyor.api.responses import ChatFormat, _chat_logprobs
from conveyor.api.structured import refuse_unknown_keys
from conveyor.errors import InvalidRequestError
from conveyor.structured.spec import GrammarSpec, closed_objects

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCED = re.compile(r"\s*```(?:json)?[ \t]*\n(.*?)\n?[ \t]*```\s*", re.DOTALL)
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int) -> dict[str, Any]:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]]  # as sent: what the chat template renders
    spec: GrammarSpec | None = None
    param: str = "tools"
    function_name: str | None = None  # of a named tool_choice
    parallel: bool = True  # parallel_tool_calls false: an "auto" output's first call is its only one

    @property
    def names(self) -> set[str]:
        return {tool["function"]["name"] for tool in self.tools}


def _parameters(tool: Any, i: int) -> tuple[str, dict[str, Any]]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f"tools.{i} must be {{'type': 'function', 'function': {{...}}}}", param=f"tools.{i}")
    refuse_unknown_keys(tool, ("type", "function"), f"tools.{i}")
    function = tool["function"]
    refuse_unknown_keys(function, ("name", "description", "parameters", "strict"), f"tools.{i}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"tools.{i}.function.name must be a non-empty string", param=f"tools.{i}.function.name")
    if not isinstance(function.get("description", ""), (str, type(None))):
        raise bad_request(f"tools.{i}.function.description must be a string", param=f"tools.{i}.function.description")
    params = function.get("parameters", _NO_PARAMETERS)
    if not isinstance(params, dict):
        raise bad_request(f"tools.{i}.function.parameters must be a JSON schema object",
                          param=f"tools.{i}.function.parameters")
    strict = function.get("strict")
    if not isinstance(strict, (bool, type(None))):  # "false" would be truthy
        raise bad_request(f"tools.{i}.function.strict must be a boolean", param=f"tools.{i}.function.strict")
    return name, closed_objects(params) if strict else params


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None = None) -> ToolPlan | None:
    """What the request's tools and tool_choice ask for; 400s name the offending field."""
    plan = _plan(tools, tool_choice)
    if plan is not None and parallel_tool_calls is False:
        plan.parallel = False
    return plan


def _plan(tools: list[Any] | None, tool_choice: Any) -> ToolPlan | None:
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    named = [_parameters(tool, i) for i, tool in enumerate(tools)]
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise bad_request("tools have duplicate function names", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto"):
        return ToolPlan(choice, tools)
    if choice == "required":
        variants = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                     "required": ["name", "arguments"], "additionalProperties": False} for n, p in named]
        schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
        return ToolPlan("required", tools, _schema_spec(schema, "tools"), "tools")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        refuse_unknown_keys(choice, ("type", "function"), "tool_choice")
        refuse_unknown_keys(choice["function"], ("name",), "tool_choice.function")
        wanted = choice["function"].get("name")
        if wanted not in names:
            raise bad_request(f"tool_choice names the function {wanted!r}, which is not in tools",
                              param="tool_choice.function.name")
        i = names.index(wanted)
        param = f"tools.{i}.function.parameters"
        return ToolPlan("named", tools, _schema_spec(named[i][1], param), param, wanted)
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                      "{'name': ...}}", param="tool_choice")


def _schema_spec(schema: dict[str, Any], param: str) -> GrammarSpec:
    try:
        return GrammarSpec.json_schema(schema)
    except InvalidRequestError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """(the text before the first call, the calls) of `<tool_call>{json}</tool_call>` blocks, as
    vLLM's hermes parser takes them: text after a call is not content. A block that is not a JSON
    object with a name (read strictly: no NaN, no float past its range) stays in the text."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for match in _HERMES_CALL.finditer(text):
        try:
            body = strict_json(match.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
            continue
        arguments = body.get("arguments", body.get("parameters", {}))
        calls.append(ToolCall(body["name"], arguments if isinstance(arguments, str)
                              else json.dumps(arguments, ensure_ascii=False)))
        kept.append(text[at:match.start()])
        at = match.end()
    if not calls:
        return text, calls
    return kept[0], calls


def parse_bare_calls(text: str, names: set[str]) -> list[ToolCall]:
    """The calls of an answer that is nothing but calls: a JSON object `{"name": <one of names>,
    "arguments": {...}}` or a list of them, bare or in a ```json fence, as small Qwen2.5 models
    answer with tools rendered (without the <tool_call> tags their template asks for). Anything
    else, or one object that is not such a call, is no call: the answer stays text."""
    fenced = _FENCED.fullmatch(text)
    body_text = (fenced.group(1) if fenced else text).strip()
    if not body_text.startswith(("{", "[")):
        return []
    try:
        body = strict_json(body_text)
    except ValueError:
        return []
    calls = []
    for item in body if isinstance(body, list) and body else [body]:
        if not isinstance(item, dict) or set(item) not in ({"name", "arguments"}, {"name", "parameters"}):
            return []
        arguments = item.get("arguments", item.get("parameters"))
        if item.get("name") not in names or not isinstance(arguments, dict):
            return []
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


_CALL_KEYS = ('"name"', '"arguments"', '"parameters"')


def _may_be_bare_calls(text: str) -> bool:
    """Whether an "auto" output begun so may turn out to be nothing but calls (parse_bare_calls),
    so that none of it can go out as content yet: up to its first key, a call's beginning."""
    start = text.lstrip()
    if start.startswith("```"):
        first_line, newline, start = start.partition("\n")
        if not newline:
            return True
        if first_line.strip() not in ("```", "```json"):
            return False
        start = start.lstrip()
    elif "```".startswith(start):
        return True
    if start.startswith("["):
        start = start[1:].lstrip()
        if not start:
            return True
    if not start.startswith("{"):
        return not start
    key = start[1:].lstrip()
    return any(k.startswith(key[: len(k)]) for k in _CALL_KEYS)


class ToolCallFormat(ChatFormat):
    """Chat responses whose output is (or may contain) tool calls."""

    def __init__(self, model: str, plan: ToolPlan) -> None:
        super().__init__(model)
        self.plan = plan
        self._sent: dict[int, int] = {}  # choice index -> characters of its text already streamed
        self._named_ids: dict[int, str] = {}

    def _calls(self, choice: Choice) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished choice."""
        text = choice.text
        if self.plan.mode == "named":
            call_id = self._named_ids.get(choice.index)
            call = ToolCall(self.plan.function_name or "", text)
            if call_id is not None:
                call.id = call_id
            return None, [call]
        if self.plan.mode == "required":
            try:
                body = json.loads(text)
                return None, [ToolCall(body["name"], json.dumps(body["arguments"], ensure_ascii=False))]
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []  # cut short (finish_reason "length"): what was generated
        if self.plan.mode == "auto":
            content, calls = parse_hermes(text)
            if not calls:
                calls = parse_bare_calls(text, self.plan.names)
                content = "" if calls else text
            if not self.plan.parallel:
                calls = calls[:1]
            return (content if content.strip() else None) if calls else text, calls
        return text, []

    def _finish_reason(self, choice: Choice, calls: list[ToolCall]) -> str | None:
        return "tool_calls" if calls and choice.finish_reason == "stop" else choice.finish_reason

    def choice_final(self, choice: Choice) -> dict[str, Any]:
        content, calls = self._calls(choice)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.as_dict(0).items() if k != "index"} for c in calls]
        lp = _chat_logprobs(choice.logprobs) if choice.num_logprobs is not None else None
        return {"index": choice.index, "message": message, "logprobs": lp,
                "finish_reason": self._finish_reason(choice, calls), "stop_reason": choice.stop_reason}

    def choice_delta(self, choice: Choice, delta: str, logprobs: list[TokenLogprob] | None,
                     first: bool = False) -> dict[str, Any] | None:
        lp = _chat_logprobs(logprobs) if choice.num_logprobs is not None else None
        # The role goes out with the first token, as ChatFormat sends it.
        out: dict[str, Any] = {"role": "assistant"} if first else {}
        finish = None
        if self.plan.mode == "named":
            if delta:
                entry: dict[str, Any] = {"index": 0, "function": {"arguments": delta}}
                if choice.index not in self._named_ids:
                    call = ToolCall(self.plan.function_name or "", "")
                    self._named_ids[choice.index] = call.id
                    entry = {"index": 0, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": delta}}
                out["tool_calls"] = [entry]
            if choice.finished:
                finish = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
        else:
            sent = self._sent.get(choice.index, 0)
            if choice.finished:
                content, calls = self._calls(choice)
                if calls:
                    at = choice.text.find(TOOL_CALL_OPEN) if self.plan.mode == "auto" else -1
                    rest = choice.text[sent:at] if at > sent else ""
                    out["tool_calls"] = [c.as_dict(i) for i, c in enumerate(calls)]
                else:
                    rest = choice.text[sent:]
                if rest:
                    out["content"] = rest
                finish = self._finish_reason(choice, calls)
            elif self.plan.mode in ("auto", "none"):
                safe = len(choice.text)
                if self.plan.mode == "auto":
                    safe = 0 if sent == 0 and _may_be_bare_calls(choice.text) else _safe_content_end(choice.text)
                if safe > sent:
                    out["content"] = choice.text[sent:safe]
                    self._sent[choice.index] = safe
        if not out and finish is None and not lp:
            return None
        return {"index": choice.index, "delta": out, "logprobs": lp, "finish_reason": finish,
                "stop_reason": choice.stop_reason if finish is not None else None}


def _safe_content_end(text: str) -> int:
    """How much of an "auto" output is surely content: up to a tool call, or a tail that may start one."""
    at = text.find(TOOL_CALL_OPEN)
    if at >= 0:
        return at
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:k]):
            return len(text) - k
    return len(text)
