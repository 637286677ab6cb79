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
from typing import Annotated, Any, AsyncIterator, Callable, Literal

from pydantic import Field, field_validator, model_validator

from conveyor.api.chat_translation import chat_deltas
from conveyor.api.errors import APIError, anthropic_error_type
from conveyor.api.generation import Generation
from conveyor.api.limits import strict_json
from conveyor.api.protocol import RequestId, Text, TopK, TopP, _Strict
from conveyor.api.responses import CompletionFormat, failure, sse_event
from conveyor.api.tools import ToolCallFormat

class CacheControl(_Strict):
    """A prompt-caching breakpoint: this server's prefix cache matches every request's blocks
    anyway, so a breakpoint asks for nothing more."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


NonEmptyText = Annotated[Text, Field(min_length=1)]  # Anthropic: "text content blocks must be non-empty"


class TextBlock(_Strict):
    type: Literal["text"]
    text: NonEmptyText
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # an earlier answer's, sent back: the text is what the model reads


class ToolResultText(_Strict):
    type: Literal["text"]
    text: NonEmptyText
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ContentBlock(_Strict):
    """A block of a message: text, a tool call an earlier answer made (tool_use), or its result."""

    type: Literal["text", "tool_use", "tool_result"]
    text: NonEmptyText | None = None
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
    role: Literal["user", "assistant", "system"]  # the SDK's SystemMessageParam: a system message in place
    content: NonEmptyText | Annotated[list[ContentBlock], Field(min_length=1)]

    @property
    def blocks(self) -> list[ContentBlock]:
        if isinstance(self.content, str):
            return [ContentBlock.model_validate({"type": "text", "text": self.content})]
        return self.content

    @model_validator(mode="after")
    def _well_formed(self) -> "AnthropicMessage":
        """Anthropic's rules: a tool_use is an assistant's and a tool_result a user's."""
        kinds = [block.type for block in self.blocks]
        if "tool_use" in kinds and self.role != "assistant":
            raise ValueError(f"a {self.role} message holds no tool_use block: only an assistant's calls are")
        if "tool_result" in kinds and self.role != "user":
            raise ValueError(f"a {self.role} message holds no tool_result block: only a user's are")
        return self


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
            raise ValueError(f"only custom tools (a name and an input_schema) are supported by this server, not "
                             f"{kind!r}: Anthropic's own tool types (web search, code execution, bash, text editor, "
                             "computer use, ...) are not served")
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
    name: Text | None = Field(None, min_length=1)
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
    """Anthropic's POST /v1/messages/count_tokens body: what the prompt is made of."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None

    unsupported = {"mcp_servers": (None, []), "context_management": (None,)}

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "".join(block.text for block in self.system)
        return self.system

    def continues(self) -> bool:
        """Whether the reply continues the last message, an assistant's text (Anthropic's prefill)."""
        last = self.messages[-1]
        return last.role == "assistant" and all(block.type == "text" for block in last.blocks)

    def chat_messages(self) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """Chat messages, and where each came from (`messages.3` and `messages.3.tool_calls.0`,
        the chat's paths -> the Messages request's, for chat_translation.renamed). Consecutive
        turns of one role are one turn, as Anthropic combines them; each tool_result is a tool
        message, before the user's text beside it; each tool_use a call of its assistant turn."""
        system = self.system_text()
        messages: list[dict[str, Any]] = []
        fields: dict[str, str] = {}

        def add(message: dict[str, Any], field: str) -> None:
            fields[f"messages.{len(messages)}"] = field
            messages.append(message)

        if system:
            add({"role": "system", "content": system}, "system")
        for i, message in enumerate(self.messages):
            if message.role == "system":
                add({"role": "system", "content": "".join(b.text or "" for b in message.blocks)}, f"messages.{i}")
                continue
            for b, block in enumerate(message.blocks):
                if block.type == "tool_result":
                    add({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.result_text},
                        f"messages.{i}.content.{b}")
            text = "".join(block.text or "" for block in message.blocks if block.type == "text")
            calls = [(b, block) for b, block in enumerate(message.blocks) if block.type == "tool_use"]
            if message.role == "user" and not text:
                continue
            last = messages[-1] if messages else None
            if last is not None and last["role"] == message.role and "tool_calls" not in last:
                last["content"] = ((last["content"] or "") + "\n" + text) if last["content"] else text or None
            else:
                add({"role": message.role, "content": text or (None if calls else "")}, f"messages.{i}")
            if calls:
                turn = messages[-1]
                at = len(turn.setdefault("tool_calls", []))
                fields.setdefault(f"messages.{len(messages) - 1}.tool_calls", f"messages.{i}.content.{calls[0][0]}")
                for j, (b, block) in enumerate(calls):
                    fields[f"messages.{len(messages) - 1}.tool_calls.{at + j}"] = f"messages.{i}.content.{b}"
                    turn["tool_calls"].append({"id": block.id, "type": "function", "function": {
                        "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        return messages, fields

    def chat_body(self, request_id: str) -> dict[str, Any]:
        """The /v1/chat/completions body this request is; its engine requests named after `request_id`."""
        continues = self.continues()
        body: dict[str, Any] = {
            "model": self.model, "messages": self.chat_messages()[0], "request_id": request_id,
            "add_generation_prompt": not continues, "continue_final_message": continues,
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
        return body


class MessagesRequest(CountTokensRequest):
    """Anthropic's POST /v1/messages body."""

    max_tokens: int = Field(ge=1)  # required, as Anthropic's
    stop_sequences: list[Text] | None = None
    stream: bool | None = False
    # Anthropic's ranges; newer clients send them in extra_body (the API deprecates them).
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: AnthropicMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    request_id: RequestId | None = None  # vLLM's, as on chat: names the engine's request

    unsupported = {"container": (None,), "mcp_servers": (None, []), "context_management": (None,),
                   "diagnostics": (None,), "inference_geo": (None,), "speed": (None, "standard")}

    def chat_body(self, request_id: str) -> dict[str, Any]:
        body = super().chat_body(request_id)
        body.update(max_tokens=self.max_tokens, stop=self.stop_sequences, temperature=self.temperature,
                    top_p=self.top_p, top_k=self.top_k, stream=self.stream,
                    user=self.metadata.user_id if self.metadata is not None else None)
        return {key: value for key, value in body.items() if value is not None}


# The chat pipeline's fields, as a Messages request names them (chat_translation.renamed).
CHAT_FIELDS = (
    (r"^response_format\.json_schema\.schema", "output_config.format.schema"),
    (r"^response_format(\.json_schema)?", "output_config.format"),
    (r"^tool_choice\.function\.name", "tool_choice.name"),
    (r"^tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"),
    (r"^tools\.(\d+)\.function\.", r"tools.\1."),
    (r"^stop$", "stop_sequences"),
    (r"^continue_final_message$", "messages"),
)


_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


@dataclass
class MessageBuilder:
    """The message answered and, streamed, its events, from the chat format's deltas (as
    ResponseBuilder does for the Responses API)."""

    model: str
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    _blocks: list[dict[str, Any]] = field(default_factory=list, init=False)
    _open: int | None = field(default=None, init=False)  # index of the block being streamed
    _calls: dict[int, int] = field(default_factory=dict, init=False)  # tool-call index -> block index
    _started: bool = field(default=False, init=False)

    def _stop(self, gen: Generation, finish: str | None) -> tuple[str | None, str | None]:
        choice = gen.choices[0]
        if isinstance(choice.stop_reason, str) and finish == "stop":
            return "stop_sequence", choice.stop_reason
        return _STOP_REASONS.get(finish or "", "end_turn"), None

    def _usage(self, gen: Generation) -> dict[str, Any]:
        # Anthropic counts the prompt tokens read from its cache apart from input_tokens.
        return {"input_tokens": gen.prompt_tokens - gen.cached_tokens, "output_tokens": gen.completion_tokens,
                "cache_read_input_tokens": gen.cached_tokens, "cache_creation_input_tokens": 0}

    def envelope(self, content: list[dict[str, Any]], gen: Generation, finish: str | None = None,
                 done: bool = True) -> dict[str, Any]:
        stop_reason, stop_sequence = self._stop(gen, finish) if done else (None, None)
        usage = self._usage(gen)
        if not done:
            usage["output_tokens"] = 0
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def whole(self, gen: Generation, fmt: CompletionFormat) -> dict[str, Any]:
        final = fmt.choice_final(gen.choices[0])
        message, finish = final["message"], final["finish_reason"]
        content = [{"type": "text", "text": message["content"]}] if message.get("content") else []
        content += [_tool_use(call["id"], call["function"]["name"], call["function"]["arguments"])
                    for call in message.get("tool_calls") or []]
        return self.envelope(content, gen, finish)

    def _message_start(self, gen: Generation) -> list[str]:
        """message_start, once: after the first token, when the prompt's cached tokens are known."""
        if self._started:
            return []
        self._started = True
        return [sse_event({"type": "message_start", "message": self.envelope([], gen, done=False)}, "message_start")]

    async def events(self, gen: Generation, fmt: CompletionFormat,
                     aborted: Callable[[], APIError]) -> AsyncIterator[str]:
        """message_start, each content block's start, deltas and stop, message_delta (the stop
        reason, usage), message_stop; or an error event if the engine fails the request or aborts
        it before its end (`aborted` says what that is). A named tool call's input streams as it
        is generated; other calls come whole, and one whose arguments are no JSON object is text."""
        streams_calls = isinstance(fmt, ToolCallFormat) and fmt.plan.mode == "named"
        finish: str | None = None
        async for delta in chat_deltas(gen, fmt):
            for event in self._message_start(gen):
                yield event
            if delta.text:
                for event in self._text(delta.text):
                    yield event
            for call in delta.calls:
                for event in self._call(call, streams_calls):
                    yield event
            finish = delta.finish or finish
        for event in self._message_start(gen):
            yield event
        if gen.error is not None or finish == "abort":
            error = failure(gen) if gen.error is not None else aborted()
            yield sse_event({"type": "error", "error": {"type": anthropic_error_type(error), "message": error.message}},
                            "error")
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

    def _call(self, delta: dict[str, Any], streamed: bool) -> list[str]:
        function = delta.get("function") or {}
        arguments = function.get("arguments") or ""
        if delta["index"] not in self._calls:
            if not streamed:  # whole: as whole() gives it, a tool_use block or, no JSON object, text
                block = _tool_use(delta["id"], function.get("name", ""), arguments)
                if block["type"] == "text":
                    return self._text(block["text"])
                arguments = json.dumps(block["input"], ensure_ascii=False)
            events = self._close()
            events.append(self._start({"type": "tool_use", "id": _tool_use_id(delta["id"]),
                                       "name": function.get("name", ""), "input": {}}))
            assert self._open is not None
            self._calls[delta["index"]] = self._open
        else:
            events = []
        if arguments:
            events.append(sse_event({"type": "content_block_delta", "index": self._calls[delta["index"]],
                                     "delta": {"type": "input_json_delta", "partial_json": arguments}},
                                    "content_block_delta"))
        return events


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A tool_use block of a call; its arguments read strictly (no NaN, no float past its range:
    the answer must be JSON). Arguments that are no JSON object (cut at max_tokens, or a model's
    odd call) are not a call's input: the call goes back as the text the model wrote."""
    try:
        parsed = strict_json(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        text = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return {"type": "text", "text": text}
    return {"type": "tool_use", "id": _tool_use_id(call_id), "name": name, "input": parsed}


__all__ = ["CHAT_FIELDS", "CountTokensRequest", "MessageBuilder", "MessagesRequest"]
