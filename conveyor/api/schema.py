"""The API's schema as /openapi.json serves it: the response shapes (so client generators and
fuzzers can check answers) and the request bodies, which the handlers read themselves (to bound
their size before decoding) and so must be declared by hand."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from conveyor.api.openai_responses import MAX_METADATA_KEYS
from conveyor.api.protocol import MAX_N, SEED_MAX, SEED_MIN
from conveyor.sampling.params import (_MAX_ALLOWED_TOKEN_IDS, _MAX_BAD_WORDS, _MAX_BAD_WORDS_CHARS, _MAX_LOGIT_BIAS,
                                      _MAX_STOP_STRINGS)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a string with encoding_format "base64": little-endian float32s


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[ChatTokenLogprob]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"]
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str


class ResponseObject(BaseModel):
    """OpenAI's response object (/v1/responses), with the settings it was made with."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    completed_at: int | None
    error: dict[str, str] | None
    incomplete_details: dict[str, str] | None
    model: str
    output: list[OutputMessage | FunctionCallItem]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    previous_response_id: str | None
    store: bool
    temperature: float
    top_p: float
    parallel_tool_calls: bool
    tool_choice: str | dict[str, str]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: Literal["auto", "disabled"]
    metadata: dict[str, str]
    background: bool
    max_tool_calls: int | None
    prompt_cache_key: str | None
    prompt_cache_retention: str | None
    reasoning: dict[str, None]
    safety_identifier: str | None
    service_tier: str
    top_logprobs: int
    user: str | None


class AnthropicReply(BaseModel):
    """Anthropic's message (/v1/messages): content blocks, its stop reason, usage."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: dict[str, int]


class TokenCount(BaseModel):
    input_tokens: int


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
    content: str  # the same text, where llama-server's clients read it


class Version(BaseModel):
    version: str


_ERRORS = {"model": ErrorResponse}
V1_ERRORS: dict[int | str, dict[str, Any]] = {401: {**_ERRORS, "description": "missing or wrong API key"}}
GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    **V1_ERRORS,
    400: {**_ERRORS, "description": "invalid request; `param` names the field"},
    404: {**_ERRORS, "description": "unknown model"},
    413: {**_ERRORS, "description": "body larger than --max-request-bytes"},
    500: {**_ERRORS, "description": "engine fault (generic message; details in the server log)"},
    503: {**_ERRORS, "description": "waiting queue full or shutting down (Retry-After)"},
}


class OllamaError(BaseModel):
    error: str


_OLLAMA = {"model": OllamaError}
# Ollama's API (/api/...): its errors are {"error": "<message>"}; streamed answers are
# newline-delimited JSON objects.
OLLAMA_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {**_OLLAMA, "description": "invalid request; the message names the field"},
    401: {**_OLLAMA, "description": "missing or wrong API key"},
    404: {**_OLLAMA, "description": "unknown model"},
    500: {**_OLLAMA, "description": "engine fault (generic message; details in the server log)"},
    503: {**_OLLAMA, "description": "waiting queue full or shutting down (Retry-After)"},
}


# Prometheus' text exposition format, not JSON.
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus metrics, text exposition format 0.0.4",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
}

TOKENIZER_ERRORS: dict[int | str, dict[str, Any]] = {
    key: GENERATION_ERRORS[key] for key in (401, 400, 404, 413)
}
MODEL_ERRORS: dict[int | str, dict[str, Any]] = {key: GENERATION_ERRORS[key] for key in (401, 404)}
RESPONSE_ERRORS: dict[int | str, dict[str, Any]] = {
    **V1_ERRORS, 404: {**_ERRORS, "description": "no response of that id is stored (store: false, dropped, deleted)"}}


def generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    # With "stream": true: Server-Sent Events whose data are chunk objects, then "[DONE]" (on
    # /v1/responses: typed events, each named in an `event:` line, and no "[DONE]"). No schema
    # is declared for them: OpenAPI 3.1 has no way to describe the events one by one.
    stream: dict[str, Any] = {"text/event-stream": {}}
    return {200: {"model": model, "content": stream}, **GENERATION_ERRORS}


@dataclass(frozen=True)
class ServedLimits:
    """What the handlers and the engine enforce beyond the request models' types, known once the
    model is loaded. Stated in /openapi.json, so that a request the schema admits is one the server
    serves, except where validity depends on content no schema can judge: a prompt that fits the
    context once tokenized, a grammar that compiles, a chat template that accepts the messages.
    None: not known here (nothing is stated)."""

    model_names: tuple[str, ...]
    capacity: int  # tokens one request can hold, prompt and output
    vocab_size: int | None = None
    max_prompt_chars: int | None = None  # a longer text prompt cannot fit
    max_num_seqs: int | None = None  # n (samples of one request) may not exceed it
    priority_scheduling: bool | None = None  # False: a nonzero priority is refused
    template_variables: frozenset[str] | None = None  # what chat_template_kwargs may name
    renders_tools: bool | None = None  # False: tool_choice "auto", and tools beside "none", are refused
    infill: bool | None = None  # False: no fill-in-the-middle tokens, a nonempty suffix is refused
    embedding_size: int | None = None  # the only `dimensions` an embedding request may ask for
    shortest_chat: int | None = None  # the fewest tokens a rendered chat prompt takes


def _choices(prop: dict[str, Any]) -> list[dict[str, Any]]:
    """The non-null alternatives of a property (`X | None` is anyOf [X, null] in pydantic's schema)."""
    return [alt for alt in prop.get("anyOf", [prop]) if alt.get("type") != "null"]


def _set(props: dict[str, Any], name: str, **keywords: Any) -> None:
    for alt in _choices(props[name]):
        alt.update(keywords)


def _describe(props: dict[str, Any], name: str, text: str) -> None:
    props[name]["description"] = text


def _below(n: int) -> str:
    """A regex for the decimal integers 0 .. n-1 (no leading zeros): token ids as JSON object keys."""
    digits = str(n - 1)
    parts = ["0", f"[1-9][0-9]{{0,{len(digits) - 2}}}"] if len(digits) > 1 else []
    for i, d in enumerate(digits):
        low = 1 if i == 0 and len(digits) > 1 else 0  # "0" itself is among the shorter numbers
        rest = len(digits) - i - 1
        if int(d) > low:
            parts.append(digits[:i] + f"[{low}-{int(d) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    parts.append(digits)
    return "^(?:" + "|".join(parts) + ")$"


def _only_if(field: str, then: dict[str, Any], required: tuple[str, ...] = (),
             off: tuple[Any, ...] = (None,)) -> dict[str, Any]:
    """`dependentSchemas` entry: when `field` is given other than `off`, `then` holds. (Generators
    expand this form more cheaply than an if/then.)"""
    return {field: {"anyOf": [{"properties": {field: {"enum": list(off)}}},
                              {"properties": then, "required": list(required)}]}}


# Rules that tie fields together multiply the alternatives a schema-driven generator (schemathesis)
# expands, and it gives up on a body past a few dozen. Each body states the rules it can afford, the
# most used ones first, and its fields' descriptions say the others.
_CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar")


def _priority(props: dict[str, Any], limits: ServedLimits) -> None:
    if limits.priority_scheduling is False:
        _set(props, "priority", const=0)
        _describe(props, "priority", "needs a server run with --scheduling-policy priority")
    else:
        _set(props, "priority", minimum=SEED_MIN, maximum=SEED_MAX)


def _priority_and_truncation(props: dict[str, Any], limits: ServedLimits) -> None:
    """vLLM's priority and truncate_prompt_tokens, which generation and embeddings share."""
    _priority(props, limits)
    # -1 (as many as the model takes) is accepted too; "-1 or >= 1" would cost the generators a branch.
    _set(props, "truncate_prompt_tokens", minimum=1)
    _describe(props, "truncate_prompt_tokens", "keep the prompt's last k tokens (k >= 1); -1 keeps as many as "
                                               "the model takes")


def _sampling_limits(schema: dict[str, Any], limits: ServedLimits) -> None:
    """The fields completions and chat share (protocol._Sampling), one by one; and one structured-
    output constraint per request."""
    props = schema["properties"]
    _set(props, "model", enum=list(limits.model_names))
    _set(props, "max_tokens", maximum=limits.capacity - 1)  # the prompt takes at least one token
    _set(props, "min_tokens", maximum=limits.capacity - 1)
    _describe(props, "min_tokens", "at most max_tokens (whose default is 16 on completions, the room the "
                                   "prompt leaves on chat)")
    max_n = MAX_N if limits.max_num_seqs is None else min(MAX_N, limits.max_num_seqs)
    _set(props, "n", maximum=max_n)
    # Sample i of a request is seeded with seed + i: every one of them must be an int64.
    _set(props, "seed", minimum=SEED_MIN, maximum=SEED_MAX - (max_n - 1))
    string, strings = _choices(props["stop"])
    string.update(minLength=1)
    strings.update(maxItems=_MAX_STOP_STRINGS, items={"type": "string", "minLength": 1})
    _set(props, "bad_words", maxItems=_MAX_BAD_WORDS,
         items={"type": "string", "pattern": r"\S", "maxLength": _MAX_BAD_WORDS_CHARS // _MAX_BAD_WORDS})
    _set(props, "allowed_token_ids", minItems=1, maxItems=_MAX_ALLOWED_TOKEN_IDS)
    if limits.vocab_size is not None:
        token_id = {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}
        for name in ("stop_token_ids", "allowed_token_ids"):
            _set(props, name, items=token_id)
        _set(props, "logit_bias", propertyNames={"pattern": _below(limits.vocab_size)})
    _set(props, "logit_bias", additionalProperties={"type": "number", "minimum": -_MAX_LOGIT_BIAS,
                                                    "maximum": _MAX_LOGIT_BIAS})
    _priority_and_truncation(props, limits)
    # Structured outputs: each field's shape, and one constraint per request.
    _set(props, "guided_regex", minLength=1)
    _set(props, "guided_grammar", minLength=1)
    _set(props, "guided_choice", minItems=1, items={"type": "string", "minLength": 1})
    for alt in _choices(props["guided_json"]):
        if alt.get("type") == "string":
            alt["minLength"] = 1
    json_schema = {"type": "object", "required": ["schema"], "additionalProperties": False,
                   "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                                  "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}
    # Each type with the keys it reads (llama.cpp's "schema" beside json_object), nothing else.
    _set(props, "response_format", required=["type"], anyOf=[
        {"properties": {"type": {"const": "text"}}, "additionalProperties": False},
        {"properties": {"type": {"const": "json_object"}, "schema": {"type": ["object", "null"]}},
         "additionalProperties": False},
        {"properties": {"type": {"const": "json_schema"}, "json_schema": json_schema}, "required": ["json_schema"],
         "additionalProperties": False}])
    _set(props, "structured_outputs", additionalProperties=False, maxProperties=1, properties={
        "json": {"type": ["object", "string"], "minLength": 1}, "regex": {"type": "string", "minLength": 1},
        "choice": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        "grammar": {"type": "string", "minLength": 1}, "json_object": {"const": True}})
    # All but (at most) one of the constraint fields are null or absent.
    schema.setdefault("allOf", []).append(
        {"anyOf": [{"properties": {other: {"type": "null"} for other in _CONSTRAINTS if other != asked}}
                   for asked in (None, *_CONSTRAINTS)]})


def _prompts(limits: ServedLimits, title: str, room: int = 1) -> dict[str, Any]:
    """A prompt field (completions' prompt, embeddings' input): a text, texts, token ids or lists
    of them, each of a size that can fit with `room` tokens to generate."""
    text: dict[str, Any] = {"type": "string", "minLength": 1}
    if limits.max_prompt_chars is not None:
        text["maxLength"] = limits.max_prompt_chars
    ids: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": limits.capacity - room, "items": {"type": "integer"}}
    if limits.vocab_size is not None:
        ids["items"] = {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}
    return {"anyOf": [text, {"type": "array", "minItems": 1, "items": text}, ids,
                      {"type": "array", "minItems": 1, "items": ids}],
            "title": title, "description": "a text, texts, token ids, or lists of token ids"}


def _completion_limits(schema: dict[str, Any], limits: ServedLimits) -> None:
    props = schema["properties"]
    props["prompt"] = _prompts(limits, "Prompt")
    # best_of is accepted only as what it means here, n: stated for n = 1.
    _describe(props, "best_of", "accepted only equal to n")
    if limits.infill is False:
        _set(props, "suffix", maxLength=0)
    _describe(props, "suffix", "fill in the middle: the text goes between the prompt and this; needs a model "
                               "with infill tokens, text prompts, and no echo" if limits.infill is not False
              else "this model has no fill-in-the-middle tokens: only empty (a plain completion)")
    # Described, not stated: one more rule tying fields together is past what generators expand here.
    _describe(props, "max_tokens", "0 only with echo: the prompt alone, scored")
    schema["dependentSchemas"] = {
        **_only_if("stream_options", {"stream": {"const": True}}, ("stream",)),
        **_only_if("best_of", {"best_of": {"const": 1}, "n": {"enum": [1, None]}}),
    }


def _embedding_limits(schema: dict[str, Any], limits: ServedLimits) -> None:
    props = schema["properties"]
    _set(props, "model", enum=list(limits.model_names))
    props["input"] = _prompts(limits, "Input", room=0)
    if limits.embedding_size is not None:
        _set(props, "dimensions", const=limits.embedding_size)
        _describe(props, "dimensions", "only the model's own width: no model served here is trained to be cut shorter")
    _priority_and_truncation(props, limits)


def _chat_limits(schema: dict[str, Any], limits: ServedLimits) -> None:
    props = schema["properties"]
    if "max_completion_tokens" in props:  # chat completions
        _set(props, "max_completion_tokens", maximum=limits.capacity - 1)
        _describe(props, "stream_options", "only with stream: true")
        _describe(props, "top_logprobs", "needs logprobs: true")
        _describe(props, "max_completion_tokens", "max_tokens, if sent too, must be the same")
        function = {"type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {"name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
                                   "parameters": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}
        _set(props, "tools", items={"type": "object", "required": ["type", "function"], "additionalProperties": False,
                                    "properties": {"type": {"const": "function"}, "function": function}})
        _describe(props, "tools", "functions with distinct names")
        named = {"type": "object", "required": ["type", "function"], "additionalProperties": False,
                 "properties": {"type": {"const": "function"}, "function": {
                     "type": "object", "required": ["name"], "additionalProperties": False,
                     "properties": {"name": {"type": "string"}}}}}
        modes = ["none", "required"] if limits.renders_tools is False else ["none", "auto", "required"]
        props["tool_choice"]["anyOf"] = [{"enum": modes}, named, {"type": "null"}]
        _describe(props, "tool_choice", "anything but 'none' needs tools, and a named function must be one of "
                                        "them; with tools and no tool_choice the choice is 'auto'"
                                        + (", which this model's chat template cannot render (nor tools beside "
                                           "'none')" if limits.renders_tools is False else ""))
    if limits.template_variables:
        _set(props, "chat_template_kwargs", propertyNames={"enum": sorted(limits.template_variables)})
    elif limits.template_variables is not None:
        _set(props, "chat_template_kwargs", maxProperties=0)
    # A reply that continues the last message cannot also start a new turn, and the message must have
    # text to continue (stated for every message: a schema cannot single out the last one).
    text = {"type": "string", "pattern": r"\S"}
    schema["dependentSchemas"] = _only_if(
        "continue_final_message", {"add_generation_prompt": {"enum": [False, None]},
                                   "messages": {"items": {"properties": {"content": text}, "required": ["content"]}}},
        off=(False, None))


def _responses_limits(schema: dict[str, Any], limits: ServedLimits) -> None:
    props = schema["properties"]
    _set(props, "model", enum=list(limits.model_names))
    _set(props, "max_output_tokens", maximum=limits.capacity - 1)
    _describe(props, "max_output_tokens", "with the input, at most the model's length (truncation 'auto' drops the "
                                          "oldest turns to make room)")
    _priority(props, limits)
    _describe(props, "previous_response_id", "a response this server stores (created with store left true, and "
                                             "neither deleted nor dropped as the least recently used)")
    _describe(props, "stream_options", "only with stream: true")
    _describe(props, "tools", "functions with distinct names")
    _describe(props, "tool_choice", "anything but 'none' needs tools, and a named function must be one of them; with "
                                    "tools and no tool_choice the choice is 'auto'"
                                    + (", which this model's chat template cannot render (nor tools beside 'none')"
                                       if limits.renders_tools is False else ""))
    _describe(props, "text", "json_object and json_schema formats cannot be combined with tool_choice 'required' "
                             "or a named function")
    _set(props, "metadata", maxProperties=MAX_METADATA_KEYS)
    next(alt for alt in _choices(props["input"]) if alt.get("type") == "array")["minItems"] = 1


def _responses_items(schemas: dict[str, Any]) -> None:
    """Which fields each kind of input item, content part and text format takes (their models'
    validators), as the chat's message rules are stated."""
    absent, present, text = {"type": "null"}, {"not": {"type": "null"}}, {"type": "string"}
    fields = ("role", "content", "call_id", "name", "arguments", "output")

    def only(kind: dict[str, Any], *taken: str, **typed: Any) -> dict[str, Any]:
        props = {"type": kind, **{f: absent for f in fields if f not in taken}, **typed}
        return {"properties": props, "required": [*typed]}

    schemas["ResponseInputItem"]["anyOf"] = [
        only({"const": "message"}, "role", "content", role=present, content=present),
        {**only({"const": "function_call"}, "call_id", "name", "arguments", call_id=text, name=text, arguments=text),
         "required": ["type", "call_id", "name", "arguments"]},
        {**only({"const": "function_call_output"}, "call_id", "output", call_id=text, output=present),
         "required": ["type", "call_id", "output"]}]
    schemas["ResponseContent"]["anyOf"] = [
        {"properties": {"type": {"enum": ["input_text", "output_text"]}, "text": text}, "required": ["text"]},
        {"properties": {"type": {"const": "refusal"}, "refusal": text}, "required": ["refusal"]}]
    schemas["ResponseTextFormat"]["anyOf"] = [
        {"properties": {"type": {"enum": ["text", "json_object"]}, "schema": absent, "name": absent}},
        {"properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}}, "required": ["schema"]}]


def _messages_limits(schemas: dict[str, Any], limits: ServedLimits) -> None:
    """Anthropic's Messages API: the served model, the context, and which fields each kind of
    content block takes (ContentBlock's validator)."""
    for name in ("MessagesRequest", "CountTokensRequest"):
        schema = schemas[name]
        props = schema["properties"]
        _set(props, "model", enum=list(limits.model_names))
        _describe(props, "tool_choice", "needs tools; a tool it names must be one of them")
        _describe(props, "tools", "with distinct names")
        _describe(props, "output_config", "a format cannot be combined with tool_choice 'any' or a named tool")
        # A tool_choice needs tools; and where the chat template renders no tools, tools need a
        # tool_choice that constrains the output ("any", a tool): left out it is "auto", and
        # beside "none" they would reach the model only through the template.
        rules = _only_if("tool_choice", {"tools": {"type": "array", "minItems": 1}}, required=("tools",))
        if limits.renders_tools is False:
            served = {"type": "object", "properties": {"type": {"enum": ["any", "tool"]}}, "required": ["type"]}
            rules |= _only_if("tools", {"tool_choice": served}, required=("tool_choice",))
        schema["dependentSchemas"] = rules
    props = schemas["MessagesRequest"]["properties"]
    _set(props, "max_tokens", maximum=limits.capacity - max(1, limits.shortest_chat or 0))
    _describe(props, "max_tokens", "with the prompt, at most the model's length")
    _set(props, "stop_sequences", maxItems=_MAX_STOP_STRINGS, items={"type": "string", "minLength": 1})
    absent, text = {"type": "null"}, {"type": "string"}
    fields = ("text", "id", "name", "input", "tool_use_id", "content", "is_error")

    def only(kind: str, *taken: str, **typed: Any) -> dict[str, Any]:
        props = {"type": {"const": kind}, **{f: absent for f in fields if f not in taken}, **typed}
        return {"properties": props, "required": ["type", *typed]}

    schemas["ContentBlock"]["anyOf"] = [
        only("text", "text", text=text),
        only("tool_use", "id", "name", "input", id=text, name=text, input={"type": "object"}),
        only("tool_result", "tool_use_id", "content", "is_error", tool_use_id=text)]
    # Which blocks each role's content holds (AnthropicMessage's validator).
    def content_of(*kinds: str) -> dict[str, Any]:
        return {"anyOf": [{"type": "string"}, {"type": "array", "items": {"properties": {"type": {"enum": list(kinds)}}}}]}

    # A template that renders no tools renders no calls either: a tool_use block would be a 400.
    calls = ("tool_use",) if limits.renders_tools is not False else ()
    schemas["AnthropicMessage"]["anyOf"] = [
        {"properties": {"role": {"const": "user"}, "content": content_of("text", "tool_result")}},
        {"properties": {"role": {"const": "assistant"}, "content": content_of("text", *calls)}},
        {"properties": {"role": {"const": "system"}, "content": content_of("text")}}]
    schemas["AnthropicToolChoice"]["anyOf"] = [
        {"properties": {"type": {"enum": ["auto", "any", "none"]}, "name": absent}},
        {"properties": {"type": {"const": "tool"}, "name": text}, "required": ["name"]}]


def state_limits(schemas: dict[str, Any], limits: ServedLimits) -> None:
    """Writes `limits` into the request bodies' schemas (components/schemas, by model name)."""
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        _sampling_limits(schemas[name], limits)
    _completion_limits(schemas["CompletionRequest"], limits)
    _embedding_limits(schemas["EmbeddingRequest"], limits)
    _responses_limits(schemas["ResponsesRequest"], limits)
    _responses_items(schemas)
    _messages_limits(schemas, limits)
    for name in ("ChatCompletionRequest", "TokenizeChatRequest"):
        _chat_limits(schemas[name], limits)
    for name in ("TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"):
        _set(schemas[name]["properties"], "model", enum=list(limits.model_names))
    if "ChatMessage" in schemas:
        # Assistant turns make tool calls (and may then have no content), tool turns answer one by
        # its id (OpenAI's rules).
        absent, present = {"type": "null"}, {"not": {"type": "null"}}
        schemas["ChatMessage"]["anyOf"] = [
            {"properties": {"role": {"enum": ["system", "developer", "user"]}, "tool_calls": absent,
                            "tool_call_id": absent, "content": present}, "required": ["content"]},
            {"properties": {"role": {"const": "assistant"}, "tool_call_id": absent}},
            {"properties": {"role": {"const": "tool"}, "tool_calls": absent, "tool_call_id": {"type": "string"},
                            "content": present}, "required": ["tool_call_id", "content"]}]
    if limits.vocab_size is not None:
        schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] = {
            "type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}


def install_openapi(app: FastAPI, request_bodies: dict[str, tuple[type[BaseModel], ...]],
                    limits: Callable[[], ServedLimits] | None = None) -> None:
    """Serve the generated schema with the request body models of the POST routes put in (a route
    that takes one of several bodies, as /tokenize does, gets their anyOf) and, where `limits`
    tells them, what the server enforces beyond the models' types."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, models in request_bodies.items():
                refs = []
                for model in models:
                    body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                    components.update(body.pop("$defs", {}))
                    components[model.__name__] = body
                    refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}},
                }
            if limits is not None:
                state_limits(components, limits())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
