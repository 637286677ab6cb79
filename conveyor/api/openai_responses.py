"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}).

A Responses request is a chat in other clothes: its `instructions` and `input` items become chat
messages, its function tools and `text.format` the chat's tools and response_format, and it runs
through the same rendering, tool planning and structured outputs as /v1/chat/completions (as
llama.cpp's server and vLLM serve it). What differs is the answer's shape: `output` items
(a message of output_text, function calls) and, streamed, typed events (`response.created`,
`response.output_text.delta`, ..., `response.completed`), each with a sequence number.

`store` (OpenAI's default: true) keeps the response in this process, in a bounded store
(`conveyor serve --max-stored-responses`, oldest dropped first), so that a later request can
continue it with `previous_response_id` (its input and output come before the new input) and
GET or DELETE it. Nothing is written to disk, and a restart forgets every response.
"""
from __future__ import annotations

import json
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Literal

from pydantic import Field, field_validator, model_validator

from conveyor.api.chat_translation import chat_deltas
from conveyor.api.errors import APIError, bad_request
from conveyor.api.generation import Generation
from conveyor.errors import NoAllowedTokenError
from conveyor.api.protocol import (
    CacheSalt, MinP, NumLogprobs, Penalty, RepetitionPenalty, RequestId, Seed, Temperature, Text, TopK, TopP, _Strict,
    text_parts_only,
)
from conveyor.api.responses import CompletionFormat, failure, sse_event, usage

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` value: output_text's logprobs
MAX_METADATA_KEYS = 16  # OpenAI's bound


class ResponseContent(_Strict):
    """A part of an input message (input_text) or of an earlier output sent back (output_text,
    refusal, with what the SDK dumps beside them)."""

    type: Literal["input_text", "output_text", "refusal"]
    text: Text | None = None
    refusal: Text | None = None
    annotations: list[Any] | None = None  # an earlier output's citations: the text is what the model reads
    logprobs: list[Any] | None = None

    @model_validator(mode="after")
    def _has_text(self) -> "ResponseContent":
        wanted = "refusal" if self.type == "refusal" else "text"
        if getattr(self, wanted) is None:
            raise ValueError(f"a {self.type} part needs {wanted}")
        return self

    @property
    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


# Which fields each item type takes; the others must be absent.
_ITEM_FIELDS = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
}
_ALL_ITEM_FIELDS = {name for names in _ITEM_FIELDS.values() for name in names}


class ResponseInputItem(_Strict):
    """One item of `input`: a message (`type` may be left out, as OpenAI's easy input message),
    a function call an earlier response made, or its output. Earlier output items may be sent back
    as the SDK dumps them (with id and status)."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: Text | list[ResponseContent] | None = None
    call_id: str | None = Field(None, min_length=1)
    name: Text | None = Field(None, min_length=1)
    arguments: Text | None = None
    output: Text | list[ResponseContent] | None = None

    # The SDK's fields of a call or its output that this server has no use for, at their off values.
    # (`async_` is how the SDK's model_dump() spells `async`.)
    unsupported = {"phase": (None,), "namespace": (None,), "caller": (None,), "async": (None, False),
                   "async_": (None, False)}

    @field_validator("content", "output", mode="before")
    @classmethod
    def _text_only(cls, parts: Any) -> Any:
        return text_parts_only(parts, ("input_text", "output_text", "refusal"))

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "ResponseInputItem":
        wanted = _ITEM_FIELDS[self.type]
        for name in wanted:
            if getattr(self, name) is None:
                raise ValueError(f"a {self.type} item needs {name}")
        for name in sorted(_ALL_ITEM_FIELDS - set(wanted)):
            if getattr(self, name) is not None:
                raise ValueError(f"a {self.type} item takes no {name}")
        return self

    @staticmethod
    def _joined(value: str | list[ResponseContent] | None) -> str:
        return value if isinstance(value, str) else "".join(part.value for part in value or [])

    @property
    def text(self) -> str:
        return self._joined(self.output if self.type == "function_call_output" else self.content)


class ResponseFunctionTool(_Strict):
    """A function the model may call (the Responses shape: name and parameters at the top)."""

    type: Literal["function"]

    @field_validator("type", mode="before")
    @classmethod
    def _functions_only(cls, kind: Any) -> Any:
        if kind != "function":
            raise ValueError(f"only function tools are supported by this server, not {kind!r} (OpenAI's hosted "
                             "tools run on OpenAI's servers)")
        return kind

    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # None: true, OpenAI's default on this API

    def as_chat_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}  # in OpenAI's order: the template renders it
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        function["strict"] = self.strict is not False
        return {"type": "function", "function": function}

    def as_echo(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict is not False}


class ResponseToolChoice(_Strict):
    type: Literal["function"]
    name: Text = Field(min_length=1)


class ResponseTextFormat(_Strict):
    """`text.format`: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> "ResponseTextFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema format needs schema")
        if self.type != "json_schema" and (self.json_schema is not None or self.name is not None):
            raise ValueError(f"a {self.type} format takes no schema or name")
        return self

    def as_response_format(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        body: dict[str, Any] = {"name": self.name or "response", "schema": self.json_schema}
        if self.description is not None:
            body["description"] = self.description
        if self.strict is not None:
            body["strict"] = self.strict
        return {"type": "json_schema", "json_schema": body}

    def as_echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class ResponseTextConfig(_Strict):
    format: ResponseTextFormat | None = None
    unsupported = {"verbosity": (None, "medium")}  # a hint to OpenAI's own models; medium is its default


class ResponseReasoning(_Strict):
    """No model served here reasons apart from its answer: only the settings that ask for no
    reasoning are taken."""

    unsupported = {"effort": (None, "none"), "summary": (None,), "generate_summary": (None,)}


class ResponseStreamOptions(_Strict):
    # OpenAI pads delta events with random characters so that their sizes leak no text; on unless
    # turned off, as OpenAI's.
    include_obfuscation: bool | None = None


class ResponsesRequest(_Strict):
    """OpenAI's POST /v1/responses body, with vLLM's sampling extensions (top_k, min_p,
    repetition_penalty, seed, request_id, priority, cache_salt)."""

    model: str | None = None
    input: Text | list[ResponseInputItem]
    instructions: Text | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    store: bool | None = None  # None: true, as OpenAI
    stream: bool | None = False
    stream_options: ResponseStreamOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: NumLogprobs | None = None
    # output_text's logprobs; or reasoning items' encrypted content, of which none is ever made.
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = None
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)  # a bound on built-in tools, of which none is served
    text: ResponseTextConfig | None = None
    reasoning: ResponseReasoning | None = None
    # "auto": the oldest input items are dropped until the input fits the context (OpenAI's rule).
    truncation: Literal["auto", "disabled"] | None = None
    # Bookkeeping for the caller, echoed in the response; they change no output.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # A hint for OpenAI's cache routing: this server's prefix cache matches every request anyway.
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory"] | None = None  # this server's cache is in memory
    service_tier: Literal["auto", "default"] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    priority: int | None = None
    cache_salt: CacheSalt | None = None
    request_id: RequestId | None = None  # names the engine's request (resp-ID), as on chat

    unsupported = {
        "background": (None, False), "conversation": (None,), "prompt": (None,), "context_management": (None,),
        "moderation": (None,), "image": (None,), "access_programs": (None,), "background_options": (None,),
        "prompt_cache_options": (None,),
    }

    @model_validator(mode="after")
    def _consistent(self) -> "ResponsesRequest":
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be an empty list")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.metadata is not None and len(self.metadata) > MAX_METADATA_KEYS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_KEYS} keys")
        return self

    @property
    def items(self) -> list[ResponseInputItem]:
        if isinstance(self.input, str):
            return [ResponseInputItem.model_validate({"role": "user", "content": self.input})]
        return list(self.input)

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)

    def message_fields(self, items: list[ResponseInputItem], num_earlier: int, start: int) -> dict[str, str]:
        """For chat_body(items[start:]), where `items` are the previous response's conversation
        (`num_earlier` items) and then the input: each chat message's path (`messages.3`, and
        `messages.3.tool_calls.0` for an assistant turn's calls) -> the field a client would fix."""

        def field_of(origin: int | None) -> str:
            at = None if origin is None else origin + start - num_earlier
            return ("instructions" if at is None else "previous_response_id" if at < 0
                    else "input" if isinstance(self.input, str) else f"input.{at}")

        return {path: field_of(origin) for path, origin in chat_messages(self.instructions, items[start:])[1].items()}

    def chat_body(self, items: list[ResponseInputItem], request_id: str) -> dict[str, Any]:
        """The /v1/chat/completions body this request is, over `items` (the input, after the
        previous response's conversation and what truncation dropped), its engine requests named
        after `request_id`."""
        body: dict[str, Any] = {
            "model": self.model, "messages": chat_messages(self.instructions, items)[0],
            "max_completion_tokens": self.max_output_tokens, "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user, "metadata": self.metadata, "safety_identifier": self.safety_identifier,
            "prompt_cache_key": self.prompt_cache_key, "service_tier": self.service_tier,
        }
        for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "top_k", "min_p",
                     "repetition_penalty", "seed", "priority", "cache_salt"):
            body[name] = getattr(self, name)
        body["request_id"] = request_id
        if self.wants_logprobs:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        if self.tools:
            body["tools"] = [tool.as_chat_tool() for tool in self.tools]
        if isinstance(self.tool_choice, ResponseToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        else:
            body["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.as_response_format()
        return {key: value for key, value in body.items() if value is not None}


def chat_messages(instructions: str | None,
                  items: list[ResponseInputItem]) -> tuple[list[dict[str, Any]], dict[str, int | None]]:
    """Chat messages of `instructions` (a system message first) and the input items: an earlier
    response's message and function calls are one assistant turn, as its chat would have been.
    Beside them, where each came from: a chat path (`messages.3`, `messages.3.tool_calls.0`, and
    `messages.3.tool_calls` for the first call) -> the index of its item (None: the instructions)."""
    messages: list[dict[str, Any]] = []
    origins: dict[str, int | None] = {}

    def add(message: dict[str, Any], origin: int | None) -> None:
        origins[f"messages.{len(messages)}"] = origin
        messages.append(message)

    if instructions:
        add({"role": "system", "content": instructions}, None)
    for index, item in enumerate(items):
        last = messages[-1] if messages else None
        if item.type == "function_call":
            if last is None or last["role"] != "assistant":
                add({"role": "assistant", "content": None}, index)
            calls = messages[-1].setdefault("tool_calls", [])
            path = f"messages.{len(messages) - 1}.tool_calls"
            origins.setdefault(path, index)
            origins[f"{path}.{len(calls)}"] = index
            calls.append({"id": item.call_id, "type": "function",
                          "function": {"name": item.name, "arguments": item.arguments}})
        elif item.type == "message" and item.role == "assistant" and last is not None and last["role"] == "assistant":
            last["content"] = (last["content"] or "") + item.text
        elif item.type == "message":
            add({"role": item.role, "content": item.text}, index)
        else:
            add({"role": "tool", "tool_call_id": item.call_id, "content": item.text}, index)
    return messages, origins


def turn_starts(items: list[ResponseInputItem]) -> list[int]:
    """Where truncation may cut the input (OpenAI's "auto" drops the oldest items): before each
    user message but the first, so that no call is cut from its output."""
    return [i for i, item in enumerate(items) if i and item.type == "message" and item.role == "user"]


# The chat pipeline's fields, as a Responses request names them (chat_translation.renamed).
CHAT_FIELDS = (
    (r"^response_format\.json_schema\.schema", "text.format.schema"),
    (r"^response_format(\.json_schema)?", "text.format"),
    (r"^max_(completion_)?tokens", "max_output_tokens"),
    (r"^logprobs", "top_logprobs"),
    (r"^tool_choice\.function\.name", "tool_choice.name"),
    (r"^tools\.(\d+)\.function\.", r"tools.\1."),
    (r"^messages(\..*)?$", "input"),
)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# What a stored item costs beyond its text (the model object, its fields): a rough allowance, so
# that a store of many short items is bounded too.
_ITEM_OVERHEAD_BYTES = 512


def _item_bytes(item: ResponseInputItem) -> int:
    return _ITEM_OVERHEAD_BYTES + len(item.text) + len(item.arguments or "")


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET returns it
    # Every item a response continuing this one comes after: the conversation before it, its own
    # input, its output. Whole, so that continuing needs this response alone; the items of the
    # conversation before it are the very objects the response holding them has, not copies.
    conversation: list[ResponseInputItem]
    body_bytes: int

    @classmethod
    def of(cls, body: dict[str, Any], before: list[ResponseInputItem],
           own_input: list[ResponseInputItem]) -> "StoredResponse":
        output = [_as_input(item) for item in body["output"]]
        return cls(body, [*before, *own_input, *output], len(json.dumps(body)))


class ResponseStore:
    """Responses kept for previous_response_id and GET / DELETE: at most `capacity` of them and
    about `max_bytes` in all, the least recently used dropped first. An item several stored
    conversations share is counted once."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.size = 0
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._holders: dict[int, int] = {}  # id(item) -> stored responses holding it (each holds it alive)

    def __len__(self) -> int:
        return len(self._responses)

    @property
    def keeps(self) -> bool:
        return self.capacity > 0 and self.max_bytes > 0

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """False if it is not kept: nothing is, or it alone is past the byte budget."""
        new_bytes = stored.body_bytes + sum(_item_bytes(i) for i in stored.conversation if id(i) not in self._holders)
        if not self.keeps or new_bytes > self.max_bytes:
            return False
        self.delete(response_id)
        self._responses[response_id] = stored
        self._count(stored, +1)
        while len(self._responses) > self.capacity or self.size > self.max_bytes:
            self._count(self._responses.popitem(last=False)[1], -1)
        return True

    def delete(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is None:
            return False
        self._count(stored, -1)
        return True

    def _count(self, stored: StoredResponse, sign: int) -> None:
        self.size += sign * stored.body_bytes
        for item in stored.conversation:
            holders = self._holders.get(id(item), 0) + sign
            if holders == 0:
                del self._holders[id(item)]
                self.size -= _item_bytes(item)
            else:
                if holders == 1 and sign > 0:
                    self.size += _item_bytes(item)
                self._holders[id(item)] = holders

    def conversation(self, response_id: str) -> list[ResponseInputItem]:
        """The items a response continuing `response_id` comes after; a 400 naming
        previous_response_id if it is not stored."""
        stored = self.get(response_id)
        if stored is None:
            raise bad_request(f"previous_response_id: the response {response_id!r} is not stored on this server "
                              "(sent with store false, deleted, or dropped as the least recently used)",
                              param="previous_response_id", code="previous_response_not_found")
        return stored.conversation


def _as_input(item: dict[str, Any]) -> ResponseInputItem:
    """An output item as the input item that sends it back: built, not validated (the model's own
    output may hold what a client's input may not, such as a lone surrogate in a call's arguments;
    sent back, the chat's validation refuses it by name)."""
    if item["type"] == "message":
        parts = [ResponseContent.model_construct(type="output_text", text=part["text"]) for part in item["content"]]
        return ResponseInputItem.model_construct(type="message", role="assistant", content=parts)
    return ResponseInputItem.model_construct(**{key: item[key] for key in ("type", "call_id", "name", "arguments")})


@dataclass
class ResponseBuilder:
    """The response object and, streamed, its events, from what the chat format makes of each
    token: text deltas become an output_text message, tool-call deltas function_call items."""

    request: ResponsesRequest
    response_id: str
    model: str
    temperature: float
    top_p: float
    stored: bool  # whether it is to be kept (store left true, and the server keeps responses)
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list, init=False)
    _sequence: int = field(default=0, init=False)
    _message: dict[str, Any] | None = field(default=None, init=False)  # the message item being streamed
    _calls: dict[int, dict[str, Any]] = field(default_factory=dict, init=False)  # tool-call index -> its item
    # Logprobs of tokens that added no text yet: they go to the message that text opens (a call's
    # tokens have none in this API).
    _pending_logprobs: list[dict[str, Any]] = field(default_factory=list, init=False)

    def envelope(self, status: str, gen: Generation | None = None, finish_reason: str | None = None) -> dict[str, Any]:
        request = self.request
        tool_choice: Any = request.tool_choice
        if isinstance(tool_choice, ResponseToolChoice):
            tool_choice = tool_choice.model_dump()
        text_format = request.text.format if request.text is not None else None
        done = status in ("completed", "incomplete")
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": request.max_tool_calls, "model": self.model, "output": list(self.output),
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "prompt_cache_key": request.prompt_cache_key, "prompt_cache_retention": request.prompt_cache_retention,
            "reasoning": {"effort": None, "summary": None},
            "safety_identifier": request.safety_identifier, "service_tier": "default",
            "store": self.stored and status != "failed", "temperature": self.temperature,
            "text": {"format": text_format.as_echo() if text_format is not None else {"type": "text"}},
            "tool_choice": tool_choice or "auto",
            "tools": [tool.as_echo() for tool in request.tools or []],
            "top_logprobs": request.top_logprobs or 0, "top_p": self.top_p,
            "truncation": request.truncation or "disabled",
            "usage": _usage(gen) if gen is not None and done else None,
            "user": request.user, "metadata": request.metadata or {},
        }

    def whole(self, gen: Generation, fmt: CompletionFormat) -> dict[str, Any]:
        """The finished response (not streamed), from the chat format's final message."""
        final = fmt.choice_final(gen.choices[0])
        self.output = _output_items(final)
        return self.envelope(_status(final["finish_reason"]), gen, final["finish_reason"])

    def _event(self, kind: str, obfuscate: bool = False, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        if obfuscate:
            body["obfuscation"] = secrets.token_urlsafe(secrets.randbelow(12) + 4)
        return sse_event(body, kind)

    async def events(self, gen: Generation, fmt: CompletionFormat, on_done: Callable[[dict[str, Any]], None],
                     aborted: Callable[[], APIError]) -> AsyncIterator[str]:
        """The streamed response: created, in_progress, each output item's events as its tokens
        come, then completed, incomplete (cut at max_output_tokens) or failed. `on_done` gets the
        finished response before its last event goes out (a client may continue it at once; it
        may set `store`); `aborted` says what an abort before the end is."""
        options = self.request.stream_options
        obfuscate = options is None or options.include_obfuscation is not False
        yield self._event("response.created", response=self.envelope("in_progress"))
        yield self._event("response.in_progress", response=self.envelope("in_progress"))
        finish: str | None = None
        async for delta in chat_deltas(gen, fmt):
            if delta.text:
                for event in self._text(delta.text, delta.logprobs, obfuscate):
                    yield event
            elif delta.calls:
                self._pending_logprobs = []
            elif self._message is not None:
                self._message["content"][0]["logprobs"] += delta.logprobs
            else:
                self._pending_logprobs += delta.logprobs
            for call in delta.calls:
                for event in self._call(call, obfuscate):
                    yield event
            finish = delta.finish or finish
        if gen.error is not None or finish == "abort":
            yield self._failed(failure(gen) if gen.error is not None else aborted(), gen)
            return
        status = _status(finish)
        if not self.output:  # nothing generated (an end-of-text first): an empty message, as whole() gives
            for event in self._text("", [], obfuscate):
                yield event
        for event in self._close_message(status if not self._calls else "completed"):
            yield event
        calls = list(self._calls.values())
        for n, call in enumerate(calls):
            yield self._event("response.function_call_arguments.done", item_id=call["id"],
                              output_index=self.output.index(call), name=call["name"], arguments=call["arguments"])
            call["status"] = status if n == len(calls) - 1 else "completed"
            yield self._event("response.output_item.done", output_index=self.output.index(call), item=call)
        # The finished response is the one whole() gives (and what is kept), under the ids streamed.
        streamed, self.output = self.output, _output_items(fmt.choice_final(gen.choices[0]))
        for item in self.output:
            same = next((s for s in streamed if s["type"] == item["type"]), None)
            if same is not None:
                streamed.remove(same)
                item["id"] = same["id"]
                if item["type"] == "function_call":
                    item["call_id"] = same["call_id"]
        final = self.envelope(status, gen, finish)
        on_done(final)
        yield self._event(f"response.{final['status']}", response=final)

    def _failed(self, error: APIError, gen: Generation) -> str:
        """response.failed, with the error in OpenAI's codes (conveyor's own in the message)."""
        for item in self.output:
            if item["status"] == "in_progress":
                item["status"] = "incomplete"
        body = self.envelope("failed")
        code = "invalid_prompt" if isinstance(gen.error, NoAllowedTokenError) else "server_error"
        body["error"] = {"code": code, "message": error.message}
        return self._event("response.failed", response=body)

    def _text(self, text: str, logprobs: list[dict[str, Any]], obfuscate: bool) -> list[str]:
        events = []
        if self._message is None:
            self._message = {"id": _item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                             "content": []}
            self.output.append(self._message)
            index = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=index, item=self._message))
            self._message["content"].append(_text_part("", []))
            events.append(self._event("response.content_part.added", item_id=self._message["id"], output_index=index,
                                      content_index=0, part=_text_part("", [])))
        logprobs, self._pending_logprobs = self._pending_logprobs + logprobs, []
        part = self._message["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        events.append(self._event("response.output_text.delta", obfuscate, item_id=self._message["id"],
                                  output_index=self.output.index(self._message), content_index=0, delta=text,
                                  logprobs=logprobs))
        return events

    def _close_message(self, status: str) -> list[str]:
        message, self._message = self._message, None
        if message is None or message["status"] != "in_progress":
            return []
        index, part = self.output.index(message), message["content"][0]
        message["status"] = status
        return [
            self._event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=part["logprobs"]),
            self._event("response.content_part.done", item_id=message["id"], output_index=index, content_index=0,
                        part=part),
            self._event("response.output_item.done", output_index=index, item=message),
        ]

    def _call(self, delta: dict[str, Any], obfuscate: bool) -> list[str]:
        events = self._close_message("completed")  # text before a call is a message of its own
        function = delta.get("function") or {}
        call = self._calls.get(delta["index"])
        if call is None:
            call = _function_call(delta["id"], function.get("name", ""), "", "in_progress")
            self._calls[delta["index"]] = call
            self.output.append(call)
            events.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=call))
        arguments = function.get("arguments") or ""
        if arguments:
            call["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", obfuscate, item_id=call["id"],
                                      output_index=self.output.index(call), delta=arguments))
        return events


def _output_items(final: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items of a chat format's final choice: a message of its text (if any, or if
    there is nothing else), then its calls; the last call is what max_output_tokens cut short."""
    message, finish = final["message"], final["finish_reason"]
    status = _status(finish)
    calls = message.get("tool_calls") or []
    items = []
    if message.get("content") or not calls:
        # With calls, the logprobs cover their tokens too, which this API gives no place.
        logprobs = [] if calls else (final.get("logprobs") or {}).get("content") or []
        items.append({"id": _item_id("msg"), "type": "message", "status": status, "role": "assistant",
                      "content": [_text_part(message.get("content") or "", logprobs)]})
    for n, call in enumerate(calls):
        items.append(_function_call(call["id"], call["function"]["name"], call["function"]["arguments"],
                                    status if n == len(calls) - 1 else "completed"))
    return items


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def _function_call(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": _item_id("fc"), "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def _status(finish_reason: str | None) -> str:
    """An item's status, and the response's: cut at max_output_tokens, or whole."""
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(gen: Generation) -> dict[str, Any]:
    chat = usage(gen)
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": gen.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}


def deleted(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "deleted": True}


def not_stored(response_id: str) -> APIError:
    return APIError(404, f"no response {response_id!r} is stored on this server", param="response_id",
                    code="not_found")


__all__ = ["CHAT_FIELDS", "ResponseBuilder", "ResponseStore", "ResponsesRequest", "StoredResponse", "deleted",
           "not_stored", "turn_starts"]
