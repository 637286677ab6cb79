"""Request bodies of the OpenAI API we serve, validated strictly (wrong types are 400s).

Ranges follow OpenAI (temperature 0..2, top_p (0, 1], penalties -2..2, logit_bias -100..100,
logprobs 0..20); top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
include_stop_str_in_output, skip_special_tokens, prompt_logprobs, truncate_prompt_tokens and
add_special_tokens are vLLM's extensions. Nothing a client sends is silently ignored: a known
field we do not implement is refused (400 naming it) unless it holds its no-op value, and an
unknown field is refused as OpenAI does ("Unrecognized request argument supplied").
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from conveyor.api.errors import APIError, bad_request, from_validation
from conveyor.api.limits import strict_json
from conveyor.sampling.params import SamplingParams
from conveyor.structured.spec import GrammarSpec

MAX_N = 16
MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as OpenAI; sample seeds add their index

_ABSENT = object()
# ASCII only (\d takes other scripts' digits); 19 digits at most, past any vocabulary and far
# below int()'s 4,300-digit limit.
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,18}")


def _valid_unicode(text: str) -> str:
    """JSON may spell a lone surrogate (\\ud800) that no UTF-8 text holds: refuse it by name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode: a lone surrogate at character {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]  # text that reaches the tokenizer

# The limits of fields several request bodies share (OpenAI's ranges; vLLM's for its extensions).
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # presence and frequency
TopK = Annotated[int, Field(ge=-1)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=2.0)]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
# vLLM's: cached prompt blocks are shared only between requests that send the same salt.
CacheSalt = Annotated[str, Field(min_length=1)]
# vLLM's: the response's id is made from it (a request in flight with the same id is a 400).
RequestId = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]


def _integral(value: Any) -> Any:
    """2.0 -> 2, also inside lists; 2.5 stays a float (which a strict int field refuses)."""
    if type(value) is float and value.is_integer():
        return int(value)
    return [_integral(v) for v in value] if isinstance(value, list) else value


def _mentions(annotation: Any, kind: Any) -> bool:
    return annotation is kind or any(_mentions(arg, kind) for arg in get_args(annotation))


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    # Fields of OpenAI's or vLLM's API that this server does not implement: name -> the values
    # that mean "off" (accepted, as they ask for nothing). Anything else is a 400 naming the field.
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _integers(cls, data: Any) -> Any:
        """JSON has one kind of number: 2.0 is the integer 2, as JSON Schema's "integer" (and so the
        served schema) says. In the fields typed int (or lists of int), never in free-form ones."""
        if not isinstance(data, dict):
            return data
        for name, info in cls.model_fields.items():
            kind = info.annotation
            if name in data and _mentions(kind, int) and not _mentions(kind, float) and not _mentions(kind, Any):
                data = {**data, name: _integral(data[name])}
        return data

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        """Raises the 400 itself (pydantic passes it through), so that `param` names the field."""
        if not isinstance(data, dict):
            return data
        cls._check_unsupported(data, "")
        return {k: v for k, v in data.items() if k not in cls.unsupported}

    @classmethod
    def _check_unsupported(cls, data: dict[str, Any], path: str) -> None:
        """This model's unsupported fields and those of the models nested in it, so that `param`
        is the field's whole path (messages.1.refusal): a nested model, validated on its own
        later, would not know where it sits."""
        for name, off in cls.unsupported.items():
            value = data.get(name, _ABSENT)
            if value is not _ABSENT and not any(value == v and type(value) is type(v) for v in off):
                raise bad_request(f"{path}{name} is not supported by this server", param=f"{path}{name}",
                                  code="unsupported_parameter")
        for name, info in cls.model_fields.items():
            nested = _strict_model(info.annotation)
            value = data.get(name)
            if nested is None or value is None:
                continue
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for index, item in items:
                if isinstance(item, dict):
                    nested._check_unsupported(item, f"{path}{name}." + ("" if index is None else f"{index}."))


def _strict_model(annotation: Any) -> type[_Strict] | None:
    """The _Strict model an annotation holds (Model, Model | None, list[Model]), if any."""
    if isinstance(annotation, type) and issubclass(annotation, _Strict):
        return annotation
    return next((m for arg in get_args(annotation) if (m := _strict_model(arg)) is not None), None)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    unsupported = {"continuous_usage_stats": (None, False)}


# vLLM's sampling extensions that conveyor does not implement, on both endpoints.
_UNSUPPORTED_VLLM: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),  # beam search only
    "logits_processors": (None,),
    "spaces_between_special_tokens": (None, True),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
}


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    n: int | None = Field(None, ge=1, le=MAX_N)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(None, ge=0)
    # vLLM's extension: each choice also carries the generated token ids ("token_ids"), so a client can
    # send the next turn of a conversation as token ids that match what the server computed.
    return_token_ids: bool | None = False
    # vLLM's: logprobs name their tokens "token_id:N", for tokens whose text is not valid UTF-8.
    return_tokens_as_token_ids: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: NumLogprobs | None = None
    skip_special_tokens: bool | None = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # Default: true for completions; for chat, the BOS a template did not already write (llama.cpp's).
    add_special_tokens: bool | None = None
    user: str | None = None  # an end-user id for the caller's bookkeeping; it changes no output
    cache_salt: CacheSalt | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be generated
    priority: int | None = None  # vLLM's: with --scheduling-policy priority, lower is served sooner
    request_id: RequestId | None = None
    bad_words: list[str] | None = None  # vLLM's: words that must not be generated

    # Structured outputs (conveyor/api/structured.py): OpenAI's, and vLLM's new and older fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    unsupported = dict(_UNSUPPORTED_VLLM)

    @model_validator(mode="after")
    def _consistent(self) -> "_Sampling":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's length) or at least 1")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logit_bias_ids(self) -> dict[int, float]:
        """OpenAI sends token ids as JSON object keys, so as strings: plain decimal digits without a
        leading zero only, so that no two keys name one token (int() also takes "05", "+5", "1_000")."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise bad_request(f"logit_bias keys must be token ids in plain decimal digits, got {key[:24]!r}",
                                  param="logit_bias")
            bias[int(key)] = value
        return bias

    def sampling_params(self, max_tokens: int, logprobs: int | None, structured: GrammarSpec | None = None,
                        defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
        """Raises InvalidRequestError (a 400) for what the engine refuses. `defaults`: what the
        model recommends (ServerState.sampling_defaults) for the fields the request left out."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        model = defaults or {}

        def given(name: str) -> Any:
            value = getattr(self, name)
            return model.get(name) if value is None else value

        top_k = given("top_k")
        kwargs: dict[str, Any] = dict(
            max_tokens=max_tokens,
            temperature=1.0 if (temperature := given("temperature")) is None else temperature,
            top_p=1.0 if (top_p := given("top_p")) is None else top_p,
            top_k=top_k or 0,
            seed=self.seed,
            stop=stop,
            ignore_eos=bool(self.ignore_eos),
        )
        # Only pass what is set, so an engine without a parameter still serves the plain requests.
        optional: dict[str, tuple[Any, Any]] = dict(
            n=(self.n, 1), logprobs=(logprobs, None), prompt_logprobs=(self.prompt_logprobs, None),
            presence_penalty=(self.presence_penalty, None), frequency_penalty=(self.frequency_penalty, None),
            repetition_penalty=(given("repetition_penalty"), None), min_p=(given("min_p"), None),
            min_tokens=(self.min_tokens, None), stop_token_ids=(self.stop_token_ids, None),
            include_stop_str_in_output=(self.include_stop_str_in_output, False),
            skip_special_tokens=(self.skip_special_tokens, True), logit_bias=(self.logit_bias_ids(), {}),
            cache_salt=(self.cache_salt, None), allowed_token_ids=(self.allowed_token_ids, None),
            bad_words=(self.bad_words, []), priority=(self.priority, 0),
        )
        kwargs.update({name: value for name, (value, unset) in optional.items() if value is not None and value != unset})
        if structured is not None:
            kwargs["structured"] = structured
        try:
            return SamplingParams(**kwargs)
        except TypeError as exc:
            raise bad_request(f"this engine does not support the parameter: {exc}") from exc


class CompletionRequest(_Sampling):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt scored, nothing generated (OpenAI)
    logprobs: NumLogprobs | None = None
    echo: bool | None = False  # the prompt comes first in the text (and its logprobs, with logprobs)
    best_of: int | None = None
    # Fill in the middle: the text is what comes between the prompt and this (a code model's
    # infill tokens frame them: Tokenizer.encode_infill). "" is a plain completion, as before.
    suffix: Text | None = None

    unsupported = {**_UNSUPPORTED_VLLM, "prompt_embeds": (None,)}

    @model_validator(mode="after")
    def _completion_only(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of other than n is not supported by this server")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens of 0 asks for the prompt alone: only with echo (its text and, with "
                             "logprobs, its tokens' logprobs), else at least 1")
        if self.max_tokens == 0 and self.min_tokens:
            raise ValueError("min_tokens must be at most max_tokens")
        if self.suffix and self.echo:
            raise ValueError("echo cannot be combined with suffix: the text written goes between the prompt and "
                             "the suffix, not after the prompt")
        if self.suffix and (isinstance(self.prompt, list) and not all(isinstance(p, str) for p in self.prompt)):
            raise ValueError("suffix needs a text prompt (the code before the middle), not token ids")
        return self

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Prompt logprobs the engine must compute: vLLM's prompt_logprobs, or echo with logprobs."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


def text_parts_only(parts: Any, kinds: tuple[str, ...]) -> Any:
    """A 400 naming the first content part that is not text (an image, audio, a file), before
    the parts' own model says only that its type is wrong."""
    for index, part in enumerate(parts if isinstance(parts, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise ValueError(f"only text content is supported by this server (content part {index} is of type "
                             f"{kind!r})")
    return parts


class ContentPart(_Strict):
    type: Literal["text"]
    text: Text


class ToolCallFunction(_Strict):
    name: Text = Field(min_length=1)
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call an earlier assistant turn made: templates read these fields (and choke on others)."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction

    def as_template_input(self) -> dict[str, Any]:
        """With its arguments as the object their JSON text holds, as transformers' templates
        expect them (they write `arguments | tojson`; a string would be quoted again, and the model
        then copies the doubly encoded form), and as vLLM and llama.cpp pass them. Text that is
        not a JSON object stays text."""
        call = self.model_dump()
        try:
            arguments = strict_json(self.function.arguments) if self.function.arguments.strip() else {}
        except ValueError:
            return call
        if isinstance(arguments, dict):  # a template writes other JSON no better than the text itself
            call["function"]["arguments"] = arguments
        return call


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = Field(None, validate_default=True)
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn answering one

    # annotations: what the openai SDK's model_dump() of a reply sends back (None, or [] unused).
    unsupported = {"function_call": (None,), "audio": (None,), "annotations": (None, []),
                   "refusal": (None,), "reasoning_content": (None,)}

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content: Any, info: ValidationInfo) -> Any:
        """OpenAI's: only an assistant turn (one that called tools) may come without content."""
        if content is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"a {info.data['role']} message needs content")
        return content

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, parts: Any) -> Any:
        return text_parts_only(parts, ("text",))

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:  # [] is no calls (some clients send it so), as vLLM takes it
            message["tool_calls"] = [call.as_template_input() for call in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool | None = True
    # vLLM's (as transformers'): the reply continues the last message, which the caller began.
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables the chat template reads
    # Bookkeeping for the caller or hints to OpenAI's own service: they change no output here.
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None

    tools: list[Any] | None = None  # conveyor/api/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: an "auto" output's first call only (tools.py)

    unsupported = {
        **_UNSUPPORTED_VLLM,
        "functions": (None, []), "function_call": (None, "none"),
        "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "verbosity": (None,),
        "web_search_options": (None,), "store": (None, False),
        "echo": (None, False), "documents": (None,),
        "chat_template": (None,), "mm_processor_kwargs": (None,),
        "media_io_kwargs": (None,), "include_reasoning": (None,),
    }

    @model_validator(mode="after")
    def _chat_only(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError(f"max_completion_tokens ({self.max_completion_tokens}) and max_tokens ({self.max_tokens}), "
                             "its older name, differ: send one")
        _check_continuation(self)
        _check_tool_fields(self.messages)
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletionRequest(_Strict):
    """vLLM's POST /tokenize of a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):
    """vLLM's POST /tokenize of chat messages, rendered with the chat template."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # as chat: the BOS the template did not already write
    return_token_strs: bool | None = False

    unsupported = {"chat_template": (None,), "tools": (None, []), "mm_processor_kwargs": (None,),
                   "media_io_kwargs": (None,)}

    @model_validator(mode="after")
    def _continuation(self) -> "TokenizeChatRequest":
        _check_continuation(self)
        _check_tool_fields(self.messages)
        return self


def _check_tool_fields(messages: list[ChatMessage]) -> None:
    """As OpenAI: calls are made by assistant turns and answered by tool turns naming the call."""
    for i, message in enumerate(messages):
        if message.tool_calls is not None and message.role != "assistant":
            raise bad_request(f"messages.{i}.tool_calls: only assistant messages make tool calls, not "
                              f"{message.role}", param=f"messages.{i}.tool_calls")
        if message.tool_call_id is not None and message.role != "tool":
            raise bad_request(f"messages.{i}.tool_call_id: only tool messages answer a tool call, not "
                              f"{message.role}", param=f"messages.{i}.tool_call_id")
        if message.role == "tool" and message.tool_call_id is None:
            raise bad_request(f"messages.{i}.tool_call_id is required on a tool message",
                              param=f"messages.{i}.tool_call_id")


def _check_continuation(request: ChatCompletionRequest | TokenizeChatRequest) -> None:
    """vLLM's rule: a reply cannot both continue the last message and start a new turn (an
    add_generation_prompt left at its default gives way)."""
    if request.continue_final_message and request.add_generation_prompt \
            and "add_generation_prompt" in request.model_fields_set:
        raise ValueError("continue_final_message cannot be combined with add_generation_prompt: true")


class EmbeddingRequest(_Strict):
    """OpenAI's POST /v1/embeddings, with vLLM's extensions (truncate_prompt_tokens,
    add_special_tokens, priority, normalize, request_id). `dimensions` is taken only as the
    model's own width: no model served here is trained to be cut shorter (vLLM refuses it too)."""

    model: str | None = None
    input: Text | list[Text] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # an end-user id for the caller's bookkeeping; it changes no output
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    add_special_tokens: bool = True
    priority: int | None = None
    normalize: bool | None = None  # None: the server's (--pooling-type, on by default)
    request_id: RequestId | None = None
    cache_salt: CacheSalt | None = None  # as on completions

    # vLLM's, at the values that say what is done anyway: float32 numbers, little-endian (this CPU's)
    unsupported = {"embed_dtype": (None, "float32"), "endianness": (None, "native", "little"),
                   "mm_processor_kwargs": (None,), "additional_data": (None,)}

    @model_validator(mode="after")
    def _inputs(self) -> "EmbeddingRequest":
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be an empty list")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's length) or at least 1")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def parse(model: type[_Strict], data: Any) -> Any:
    """Validate a decoded JSON body into `model`, or raise the 400 that says what is wrong."""
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = from_validation(exc)
        if error.param is None:  # a model-level rule: its message starts with the field it is about
            first = error.message.split(" ", 1)[0]
            error.param = first if first in model.model_fields else None
        raise error from None


__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "DetokenizeRequest",
           "TokenizeChatRequest", "TokenizeCompletionRequest", "parse"]
