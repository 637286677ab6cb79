"""Request bodies of the OpenAI API subset we serve, validated strictly (wrong types are 400s).

Ranges follow OpenAI (temperature 0..2, top_p (0, 1], logprobs 0..20); top_k and ignore_eos are
vLLM's extensions. Parameters we do not implement are refused when set to a non-default value
rather than silently ignored; unknown fields are ignored, as OpenAI-compatible servers do.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from conveyor.api.errors import APIError, bad_request, from_validation
from conveyor.sampling.params import SamplingParams

MAX_N = 16
MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as OpenAI; sample seeds add their index


def _valid_unicode(text: str) -> str:
    """JSON may spell a lone surrogate (\\ud800) that no UTF-8 text holds: refuse it by name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode: a lone surrogate at character {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]  # text that reaches the tokenizer


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Text | list[Text] | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    ignore_eos: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> "_Sampling":
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(f"{name} is not supported by this server")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises InvalidRequestError (a 400) for what the engine refuses."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kwargs: dict[str, Any] = dict(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=stop,
            ignore_eos=bool(self.ignore_eos),
        )
        # Only pass what is set, so an engine without n/logprobs still serves the plain requests.
        if (self.n or 1) != 1:
            kwargs["n"] = self.n
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        try:
            return SamplingParams(**kwargs)
        except TypeError as exc:
            raise bad_request(f"this engine does not support the parameter: {exc}") from exc


class CompletionRequest(_Sampling):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_only(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of other than n is not supported by this server")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        return self


class ContentPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_only(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tools:
            raise ValueError("tools are not supported by this server")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ValueError("response_format other than text is not supported by this server")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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


__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "parse"]
