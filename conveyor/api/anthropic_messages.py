"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens).

As with the Responses API (openai_responses.py), a Messages request is served as the chat it
amounts to, as llama.cpp's server and vLLM serve it: `system` and `messages` (text, tool_use and
tool_result blocks) become chat messages, `tools` and `tool_choice` the chat's tool calls,
`output_config.format` its structured output. The answer is a message of content blocks (text,
tool_use) with Anthropic's stop reasons and usage; streamed, Anthropic's named events
(message_start, content_block_start / _delta / _stop, message_delta, message_stop).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Literal

from pydantic import Field, field_validator, model_validator

from conveyor.api.errors import APIError
from conveyor.api.generation import Generation
from conveyor.api.protocol import RequestId, Text, TopK, TopP, _Strict
from conveyor.api.responses import CompletionFormat, failure, sse_event

class CacheControl(_Strict):
    """A prompt-caching breakpoint: this server's prefix cache matches every request's blocks
    anyway, so a breakpoint asks for nothing more."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # an earlier answer's, sent back: the text is what the model reads


class ToolResultText(_Strict):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None


class ContentBlock(_Strict):
    """A block of a message: text, a tool call an earlier answer made (tool_use), or its result."""

    type: Literal["text", "tool_use", "tool_result"]
    text: Text | None = None
    id: str | None = Field(None, min_length=1)  # tool_use
    name: Text | None = Field(None, min_length=1)
    input: dict[str, Any] | None = None
    tool_use_id: str | None = Field(None, min_length=1)  # tool_result
    content: Text | list[ToolResultText] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None

    unsupported = {"caller": (None,), "toolset_name": (None,)}

    @field_validator("type", mode="before")
    @classmethod
    def _text_and_tools_only(cls, kind: Any) -> Any:
        if kind not in ("text", "tool_use", "tool_result"):
            raise ValueError(f"only text, tool_use and tool_result blocks are supported by this server, not {kind!r}")
        return kind

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "ContentBlock":
        wanted = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}[self.type]
        for name in wanted:
            if getattr(self, name) is None:
                raise ValueError(f"a {self.type} block needs {name}")
        for name in sorted({"text", "id", "name", "input", "tool_use_id", "content", "is_error"} - set(wanted)
                           - ({"content", "is_error"} if self.type == "tool_result" else set())):
            if getattr(self, name) is not None:
                raise ValueError(f"a {self.type} block takes no {name}")
        return self

    @property
    def result_text(self) -> str:
        """A tool_result's text; an error result says so, as the model cannot see the flag."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return f"Error: {text}" if self.is_error else text


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]


class AnthropicTool(_Strict):
    type: Literal["custom"] | None = None  # first: a server tool is named as that, not by what it lacks
    name: Text = Field(min_length=1, max_length=128)
    description: Text | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    cache_control: CacheControl | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _custom_only(cls, kind: Any) -> Any:
        if kind not in (None, "custom"):
            raise ValueError(f"only custom (function) tools are supported by this server, not {kind!r} "
                             "(Anthropic's server tools run on Anthropic's servers)")
        return kind

    def as_chat_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.input_schema
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_tool(self) -> "AnthropicToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("a tool choice of type 'tool' needs name, and only it takes one")
        return self

    def as_chat(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class JSONOutputFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JSONOutputFormat | None = None
    unsupported = {"effort": (None,)}  # a thinking budget: no model served here thinks apart from its answer


class ThinkingConfig(_Strict):
    type: Literal["disabled"]  # no model served here thinks apart from its answer


class AnthropicMetadata(_Strict):
    user_id: str | None = None  # the caller's bookkeeping: it changes no output


class CountTokensRequest(_Strict):
    """Anthropic's POST /v1/messages/count_tokens body: a Messages request without max_tokens
    (taken if sent, as llama.cpp's server takes it)."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    system: Text | list[TextBlock] | None = None
    stop_sequences: list[Text] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: TopP | None = None
    top_k: TopK | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: ThinkingConfig | None = None
    metadata: AnthropicMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: CacheControl | None = None
    request_id: RequestId | None = None  # vLLM's, as on chat: names the engine's request

    unsupported = {"container": (None,), "mcp_servers": (None, []), "context_management": (None,),
                   "diagnostics": (None,), "inference_geo": (None,), "speed": (None, "standard")}

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "".join(block.text for block in self.system)
        return self.system

    def chat_messages(self) -> list[dict[str, Any]]:
        """Chat messages: each tool_result a tool message (before the user's text beside it, as
        Anthropic orders them), each tool_use a call of the assistant turn it is in."""
        system = self.system_text()
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        for message in self.messages:
            blocks = ([ContentBlock.model_validate({"type": "text", "text": message.content})]
                      if isinstance(message.content, str) else message.content)
            text = "".join(block.text or "" for block in blocks if block.type == "text")
            if message.role == "assistant":
                calls = [{"id": b.id, "type": "function", "function": {"name": b.name,
                                                                       "arguments": json.dumps(b.input)}}
                         for b in blocks if b.type == "tool_use"]
                turn: dict[str, Any] = {"role": "assistant", "content": text or None}
                if calls:
                    turn["tool_calls"] = calls
                messages.append(turn)
                continue
            messages += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.result_text}
                         for b in blocks if b.type == "tool_result"]
            if text or not any(b.type == "tool_result" for b in blocks):
                messages.append({"role": "user", "content": text})
        return messages

    def chat_body(self, request_id: str) -> dict[str, Any]:
        """The /v1/chat/completions body this request is; its engine requests named after `request_id`."""
        body: dict[str, Any] = {
            "model": self.model, "messages": self.chat_messages(), "max_tokens": self.max_tokens,
            "stop": self.stop_sequences, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "stream": self.stream, "request_id": request_id,
            "user": self.metadata.user_id if self.metadata is not None else None,
        }
        if self.tools:
            body["tools"] = [tool.as_chat_tool() for tool in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice.as_chat()
            if self.tool_choice.disable_parallel_tool_use is not None:
                body["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        if self.output_config is not None and self.output_config.format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.json_schema}}
        return {key: value for key, value in body.items() if value is not None}


class MessagesRequest(CountTokensRequest):
    """Anthropic's POST /v1/messages body."""

    max_tokens: int = Field(ge=1)  # required, as Anthropic's


# The chat pipeline's field names, and what the same field is called in a Messages request.
_CHAT_PARAMS = (
    ("response_format.json_schema.schema", "output_config.format.schema"),
    ("response_format", "output_config.format"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("stop", "stop_sequences"),
)


def renamed_param(param: str | None) -> str | None:
    """A chat field's name as a Messages request names it (messages.N stays: they line up but for
    a tool_result, which the chat holds as a message of its own)."""
    if param is None:
        return None
    if param.startswith("tools.") and ".function.parameters" in param:
        return param.replace(".function.parameters", ".input_schema", 1)
    if param.startswith("tools.") and ".function." in param:
        return param.replace(".function.", ".", 1)
    for old, new in _CHAT_PARAMS:
        if param == old or param.startswith(old + "."):
            return new + param[len(old):]
    return param


_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


@dataclass
class MessageBuilder:
    """The message answered and, streamed, its events, from what the chat format makes of each
    token (as ResponseBuilder does for the Responses API)."""

    model: str
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    _blocks: list[dict[str, Any]] = field(default_factory=list, init=False)
    _open: int | None = field(default=None, init=False)  # index of the block being streamed
    _calls: dict[int, int] = field(default_factory=dict, init=False)  # tool-call index -> block index

    def _stop(self, gen: Generation, finish: str | None) -> tuple[str | None, str | None]:
        choice = gen.choices[0]
        if isinstance(choice.stop_reason, str) and finish == "stop":
            return "stop_sequence", choice.stop_reason
        return _STOP_REASONS.get(finish or "", "end_turn"), None

    def _usage(self, gen: Generation) -> dict[str, Any]:
        # Anthropic counts the prompt tokens read from its cache apart from input_tokens.
        return {"input_tokens": gen.prompt_tokens - gen.cached_tokens, "output_tokens": gen.completion_tokens,
                "cache_read_input_tokens": gen.cached_tokens, "cache_creation_input_tokens": 0}

    def envelope(self, content: list[dict[str, Any]], gen: Generation | None = None,
                 finish: str | None = None) -> dict[str, Any]:
        stop_reason, stop_sequence = self._stop(gen, finish) if gen is not None else (None, None)
        usage = self._usage(gen) if gen is not None else {"input_tokens": 0, "output_tokens": 0}
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def whole(self, gen: Generation, fmt: CompletionFormat) -> dict[str, Any]:
        final = fmt.choice_final(gen.choices[0])
        message, finish = final["message"], final["finish_reason"]
        content = [{"type": "text", "text": message["content"]}] if message.get("content") else []
        content += [_tool_use(call["id"], call["function"]["name"], call["function"]["arguments"])
                    for call in message.get("tool_calls") or []]
        return self.envelope(content, gen, finish)

    async def events(self, gen: Generation, fmt: CompletionFormat,
                     aborted: Callable[[], APIError]) -> AsyncIterator[str]:
        """message_start, each content block's start, deltas and stop, message_delta (the stop
        reason, usage), message_stop; or an error event if the engine fails the request or aborts
        it before its end (`aborted` says what that is)."""
        started = self.envelope([], None)
        started["usage"] = {"input_tokens": gen.prompt_tokens, "output_tokens": 0}
        yield sse_event({"type": "message_start", "message": started}, "message_start")
        finish: str | None = None
        first = True
        async for choice, delta, logprobs in gen.updates():
            entry = fmt.choice_delta(choice, delta, logprobs, first=first)
            first = False
            if entry is None:
                continue
            out = entry["delta"]
            if out.get("content"):
                for event in self._text(out["content"]):
                    yield event
            for call in out.get("tool_calls") or []:
                for event in self._call(call):
                    yield event
            finish = entry["finish_reason"] or finish
        if gen.error is not None or finish == "abort":
            error = failure(gen) if gen.error is not None else aborted()
            kind = "overloaded_error" if error.status == 503 else "invalid_request_error" if error.status == 400 \
                else "api_error"
            yield sse_event({"type": "error", "error": {"type": kind, "message": error.message}}, "error")
            return
        for event in self._close():
            yield event
        stop_reason, stop_sequence = self._stop(gen, finish)
        yield sse_event({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                         "usage": self._usage(gen)}, "message_delta")
        yield sse_event({"type": "message_stop"}, "message_stop")

    def _start(self, block: dict[str, Any]) -> str:
        self._blocks.append(block)
        self._open = len(self._blocks) - 1
        return sse_event({"type": "content_block_start", "index": self._open, "content_block": block},
                         "content_block_start")

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [sse_event({"type": "content_block_stop", "index": index}, "content_block_stop")]

    def _text(self, text: str) -> list[str]:
        events = []
        if self._open is None or self._blocks[self._open]["type"] != "text":
            events += self._close()
            events.append(self._start({"type": "text", "text": ""}))
        events.append(sse_event({"type": "content_block_delta", "index": self._open,
                                 "delta": {"type": "text_delta", "text": text}}, "content_block_delta"))
        return events

    def _call(self, delta: dict[str, Any]) -> list[str]:
        events = []
        function = delta.get("function") or {}
        if delta["index"] not in self._calls:
            events += self._close()
            events.append(self._start({"type": "tool_use", "id": _tool_use_id(delta["id"]),
                                       "name": function.get("name", ""), "input": {}}))
            assert self._open is not None
            self._calls[delta["index"]] = self._open
        if function.get("arguments"):
            events.append(sse_event({"type": "content_block_delta", "index": self._calls[delta["index"]],
                                     "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}},
                                    "content_block_delta"))
        return events


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A tool_use block; arguments cut short (max_tokens) are not an object, and go as {}."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    return {"type": "tool_use", "id": _tool_use_id(call_id), "name": name,
            "input": parsed if isinstance(parsed, dict) else {}}


__all__ = ["MessageBuilder", "MessagesRequest", "renamed_param"]
