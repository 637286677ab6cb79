"""Ollama's API (/api/chat, /api/generate, /api/embed, /api/embeddings, /api/tags, /api/show,
/api/ps, /api/version, /api/pull), for the clients written against Ollama: its own Python and
JavaScript libraries, Open WebUI, LangChain's ChatOllama, editors' Ollama providers.

As with the Responses and Messages APIs, a request is served as the chat or completion it amounts
to: /api/chat as /v1/chat/completions, /api/generate as a chat of one user turn (or, `raw` or with
a `suffix`, as /v1/completions), `options` as the sampling fields they name. The answer is
Ollama's: newline-delimited JSON objects when streamed (the default), `done` and `done_reason` on
the last, with the token counts and durations (nanoseconds) Ollama reports.

Load-time options (num_gpu, num_thread, use_mmap, ...) are the server's, set by its flags once:
a request naming one is refused, as is a sampler this server does not have (mirostat, typical_p,
tfs_z) or a repeat_last_n window (repeat_penalty covers the whole context, as vLLM's
repetition_penalty does).
"""
from __future__ import annotations

import datetime
import json
import re
import time
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, AsyncIterator, Callable, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from conveyor.api.chat_translation import chat_deltas
from conveyor.api.errors import APIError, bad_request
from conveyor.api.generation import Generation
from conveyor.api.limits import strict_json
from conveyor.api.protocol import Text, _Strict
from conveyor.api.responses import CompletionFormat, failure
from conveyor.model.facts import ModelFacts

# The Ollama release whose API this module follows (/api/version): clients gate features on it.
OLLAMA_API_VERSION = "0.13.0"

# Options that shape how Ollama loads a model, not how it samples: here the model is loaded once, at
# start, by the server's flags (the flag that sets each, where there is one).
LOAD_OPTIONS = {
    "numa": None, "num_batch": "--max-num-batched-tokens", "num_gpu": None, "main_gpu": None, "low_vram": None,
    "f16_kv": "--kv-cache-dtype", "logits_all": None, "vocab_only": None, "use_mmap": None, "use_mlock": None,
    "embedding_only": None, "num_thread": "--threads",
}


def _duration_seconds(value: float | str) -> float:
    """keep_alive as Ollama reads it: seconds as a number, or a Go duration ("5m", "1h30m", "-1")."""
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    if re.fullmatch(r"[-+]?\d+(\.\d+)?", text):
        return float(text)
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    match = re.fullmatch(r"([-+]?)((?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+)", text)
    if match is None:
        raise ValueError(f"keep_alive {value!r} is neither a number of seconds nor a duration such as '5m' or '1h'")
    seconds = sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", match.group(2)))
    return -seconds if match.group(1) == "-" else seconds


class Options(_Strict):
    """Ollama's `options` (a Modelfile's parameters), those that sample."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: list[Text] | Text | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = Field(None, ge=1)
    # Tokens Ollama keeps when it shifts a full context: this server never shifts one (a prompt
    # that does not fit is refused), so none are dropped to keep.
    num_keep: int | None = None
    # Ollama itself ignores it (deprecated); this server's penalties cover newlines too.
    penalize_newline: bool | None = None
    # Only with mirostat on: accepted beside mirostat 0, as Ollama takes them.
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None

    # 0 turns the repetition penalty off, as Ollama's does; -1 is the whole context, the only window
    # this server's penalty has (vLLM's repetition_penalty: the prompt and the output).
    repeat_last_n: int | None = None

    unsupported = {"mirostat": (None, 0), "typical_p": (None, 1.0), "tfs_z": (None, 1.0)}

    @model_validator(mode="before")
    @classmethod
    def _load_options(cls, data: Any) -> Any:
        """A null is an option not sent (LangChain's clients send every option, most of them null)."""
        if isinstance(data, dict):
            data = {name: value for name, value in data.items() if value is not None}
            for name in data:
                if name in LOAD_OPTIONS:
                    flag = LOAD_OPTIONS[name]
                    raise bad_request(f"options.{name} is a load-time option: this server loads its model once, at "
                                      "start" + (f", and sets it with {flag}" if flag else ""), param=f"options.{name}")
        return data

    @field_validator("repeat_last_n")
    @classmethod
    def _whole_context(cls, window: int | None) -> int | None:
        if window not in (None, 0, -1):
            raise ValueError(f"a repetition window of {window} tokens is not supported: repeat_penalty covers the whole "
                             "context (send -1, or 0 for no penalty)")
        return window

    def chat_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p, "seed": self.seed,
            "stop": self.stop, "repetition_penalty": None if self.repeat_last_n == 0 else self.repeat_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            # Ollama's (llama.cpp's) top_k 0 is the whole vocabulary, -1 here.
            "top_k": -1 if self.top_k is not None and self.top_k <= 0 else self.top_k,
        }
        # num_predict -1 (until the context is full) and -2 (fill it) are the default here.
        if self.num_predict is not None and self.num_predict >= 0:
            fields["max_tokens"] = self.num_predict
        return {k: v for k, v in fields.items() if v is not None}


class OllamaToolFunction(_Strict):
    name: Text = Field(min_length=1)
    arguments: dict[str, Any]
    index: int | None = None  # where the call stood in its turn (Ollama's streamed calls carry it)


class OllamaToolCall(_Strict):
    function: OllamaToolFunction
    id: str | None = None
    type: Literal["function"] | None = None


def _no_images(images: list[Any] | None) -> list[Any] | None:
    if images:
        raise ValueError("images are not supported: the models served here read text only")
    return images


def _stays_loaded(keep_alive: float | str) -> float | str:
    """The model stays loaded while the server runs: as long as or longer than any keep_alive but
    0, which asks to unload it."""
    if _duration_seconds(keep_alive) == 0:
        raise ValueError("keep_alive 0 unloads the model, which this server does not do: it serves one model, "
                         "loaded for as long as it runs")
    return keep_alive


Images = Annotated[list[Any], AfterValidator(_no_images)]
KeepAlive = Annotated[float | str, Field(union_mode="left_to_right"), AfterValidator(_stays_loaded)]


class OllamaMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | None = None  # null is empty, as Ollama reads it
    images: Images | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: Text | None = None  # a tool turn: the tool that answered
    tool_call_id: str | None = None  # a tool turn: the call it answers (clients that keep call ids send it)
    thinking: Text | None = None

    @field_validator("thinking")
    @classmethod
    def _no_thinking(cls, thinking: str | None) -> str | None:
        if thinking:
            raise ValueError("thinking is not supported: no model served here thinks apart from its answer")
        return thinking


Format = Literal["", "json"] | dict[str, Any]


class _OllamaRequest(_Strict):
    model: Text = Field(min_length=1)
    format: Format | None = None
    options: Options | None = None
    stream: bool | None = None  # Ollama streams unless told not to
    keep_alive: KeepAlive | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("think")
    @classmethod
    def _no_thinking(cls, think: Any) -> Any:
        if think not in (None, False):
            raise ValueError("thinking is not supported: no model served here thinks apart from its answer")
        return think

    @property
    def streams(self) -> bool:
        return self.stream is not False

    def sampling_fields(self) -> dict[str, Any]:
        """The chat's (or completion's) fields these options, format and logprobs amount to."""
        fields = self.options.chat_fields() if self.options is not None else {}
        if self.format == "json":
            fields["response_format"] = {"type": "json_object"}
        elif isinstance(self.format, dict):
            fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": self.format}}
        if self.logprobs:
            fields["logprobs"] = True
            if self.top_logprobs:
                fields["top_logprobs"] = self.top_logprobs
        elif self.top_logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        return fields

    @property
    def num_ctx(self) -> int | None:
        return self.options.num_ctx if self.options is not None else None


class OllamaChatRequest(_OllamaRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The chat's messages: each assistant call given an id, and each tool turn the id of the
        earliest call of its tool not yet answered (Ollama's turns name the tool, not the call)."""
        messages: list[dict[str, Any]] = []
        unanswered: list[tuple[str, str]] = []  # (call id, tool name), in the order they were made
        for i, message in enumerate(self.messages):
            chat: dict[str, Any] = {"role": message.role, "content": message.content or ""}
            if message.tool_calls:
                chat["tool_calls"] = []
                for j, call in enumerate(message.tool_calls):
                    call_id = call.id or f"call_{i}_{j}"
                    unanswered.append((call_id, call.function.name))
                    chat["tool_calls"].append({"id": call_id, "type": "function", "function": {
                        "name": call.function.name, "arguments": json.dumps(call.function.arguments, ensure_ascii=False)}})
            named = [k for k, (call_id, _) in enumerate(unanswered) if call_id == message.tool_call_id]
            if message.role == "tool" and named:
                chat["tool_call_id"] = unanswered.pop(named[0])[0]
            elif message.role == "tool":  # no id, or one no call of this request has: by the tool's name
                match = next((k for k, (_, name) in enumerate(unanswered) if name == message.tool_name), None)
                if match is None and message.tool_name is None and unanswered:
                    match = 0
                if match is not None:
                    chat["tool_call_id"] = unanswered.pop(match)[0]
            messages.append(chat)
        return messages

    def chat_body(self, request_id: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(), "request_id": request_id,
                                **self.sampling_fields()}
        if self.tools:
            body["tools"] = self.tools
        return body


class OllamaGenerateRequest(_OllamaRequest):
    prompt: Text = ""
    suffix: Text | None = None
    system: Text | None = None
    context: list[int] | None = None  # an earlier answer's `context`: its prompt and output tokens
    raw: bool | None = None
    images: Images | None = None

    unsupported = {"template": (None, ""), "width": (None,), "height": (None,), "steps": (None,)}

    @model_validator(mode="after")
    def _consistent(self) -> "OllamaGenerateRequest":
        if self.suffix and self.raw:
            raise bad_request("suffix cannot be combined with raw: a suffix is placed by the model's fill-in-the-middle "
                              "tokens", param="suffix")
        if self.suffix and (self.system or self.context):
            raise bad_request("suffix (fill in the middle) takes no " + ("system" if self.system else "context"),
                              param="system" if self.system else "context")
        if self.raw and self.system:
            raise bad_request("system cannot be combined with raw: a raw prompt is not templated", param="system")
        return self

    @property
    def loads_only(self) -> bool:
        """An empty request: Ollama's way to load a model (here it is loaded already)."""
        return not self.prompt and not self.suffix and not self.context

    def chat_body(self, request_id: str) -> dict[str, Any]:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.prompt})
        return {"model": self.model, "messages": messages, "request_id": request_id, **self.sampling_fields()}


def _embedding_options(options: Options | None) -> Options | None:
    others = sorted(options.model_fields_set - {"num_ctx"}) if options is not None else []
    if others:
        raise ValueError(f"an embedding samples nothing: of the options only num_ctx is taken, not {others[0]}")
    return options


class OllamaEmbedRequest(_Strict):
    model: Text = Field(min_length=1)
    input: Text | list[Text]
    truncate: bool | None = None  # Ollama's default: true
    options: Options | None = None
    keep_alive: KeepAlive | None = None
    dimensions: int | None = Field(None, ge=1)

    @field_validator("options")
    @classmethod
    def _nothing_to_sample(cls, options: Options | None) -> Options | None:
        return _embedding_options(options)


class OllamaLegacyEmbedRequest(_Strict):
    """The older /api/embeddings: one prompt, its vector not normalized."""

    model: Text = Field(min_length=1)
    prompt: Text
    options: Options | None = None
    keep_alive: KeepAlive | None = None

    @field_validator("options")
    @classmethod
    def _nothing_to_sample(cls, options: Options | None) -> Options | None:
        return _embedding_options(options)


class _NamesAModel(_Strict):
    """A request naming a model by `model` or, as older clients do, by `name`."""

    model: Text | None = Field(None, min_length=1)
    name: Text | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_name(self) -> "_NamesAModel":
        if (self.model is None) == (self.name is None):
            raise bad_request("model is required", param="model")
        return self

    @property
    def asked(self) -> str:
        return self.model or self.name or ""


class OllamaShowRequest(_NamesAModel):
    # verbose adds the file's vocabulary and every other metadata array: not served.
    unsupported = {"verbose": (None, False)}


class OllamaPullRequest(_NamesAModel):
    stream: bool | None = None

    unsupported = {"insecure": (None, False)}  # no registry is ever contacted


# The chat pipeline's fields, as an Ollama request names them (chat_translation.renamed).
CHAT_FIELDS = (
    (r"^messages\.(\d+)\.tool_call_id", r"messages.\1.tool_name"),  # when the client sent none
    (r"^response_format\.json_schema\.schema", "format"),
    (r"^response_format", "format"),
    (r"^max_tokens$", "options.num_predict"),
    (r"^repetition_penalty$", "options.repeat_penalty"),
    (r"^(temperature|top_p|top_k|min_p|seed|stop|presence_penalty|frequency_penalty)\b", r"options.\1"),
)
# /api/generate: its prompt is the chat's one user message.
GENERATE_FIELDS = (*CHAT_FIELDS, (r"^messages(\.\d+)?", "prompt"))

# SamplingParams' names of what a model recommends (--generation-config) -> a Modelfile's.
_PARAMETER_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}


def ollama_parameters(defaults: Mapping[str, float | int]) -> str:
    """/api/show's parameters: what a request that leaves them out is sampled with, as a Modelfile
    writes them."""
    return "\n".join(f"{_PARAMETER_NAMES[name]:<16}{value}" for name, value in defaults.items()
                     if name in _PARAMETER_NAMES)


def served_name(asked: str, names: Sequence[str]) -> str | None:
    """The served name `asked` means: itself, or with Ollama's default tag (`:latest`) added or left out."""
    for name in names:
        if asked in (name, f"{name}:latest") or f"{asked}:latest" == name:
            return name
    return None


def timestamp() -> str:
    """Ollama's created_at: RFC 3339, UTC."""
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def details(facts: ModelFacts | None) -> dict[str, Any]:
    if facts is None:
        return {"parent_model": "", "format": "", "family": "", "families": None, "parameter_size": "",
                "quantization_level": ""}
    return {"parent_model": "", "format": facts.format, "family": facts.family, "families": [facts.family],
            "parameter_size": facts.parameter_size, "quantization_level": facts.quantization}


def model_info(facts: ModelFacts | None, served_context: int) -> dict[str, Any]:
    """/api/show's model_info: the file's facts under GGUF's key names, as Ollama gives them."""
    if facts is None:
        return {}
    arch = facts.family
    return {"general.architecture": arch, "general.parameter_count": facts.parameter_count,
            f"{arch}.context_length": facts.context_length, f"{arch}.embedding_length": facts.embedding_length,
            f"{arch}.block_count": facts.num_layers, f"{arch}.attention.head_count": facts.num_heads,
            f"{arch}.attention.head_count_kv": facts.num_kv_heads, "conveyor.served_context_length": served_context}


def modified_at(facts: ModelFacts | None, started: float) -> str:
    moment = facts.modified if facts is not None else started
    return datetime.datetime.fromtimestamp(moment, datetime.UTC).isoformat().replace("+00:00", "Z")


def ndjson(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


@dataclass
class OllamaReply:
    """An answer to /api/chat or /api/generate, whole or as NDJSON lines, from the chat format's
    deltas (as MessageBuilder does for Anthropic's API)."""

    model: str
    chat: bool  # /api/chat (a message) or /api/generate (a response string)
    started_ns: int = field(default_factory=time.perf_counter_ns)
    context: list[int] | None = None  # /api/generate: the prompt's tokens, returned with the output's

    def _body(self, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": timestamp()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = calls
            body["message"] = message
        else:
            body["response"] = text
        return body

    def loaded(self) -> dict[str, Any]:
        """The answer to a request with nothing to generate (Ollama's way to load the model)."""
        return {**self._body(""), "done": True, "done_reason": "load"}

    def _final(self, body: dict[str, Any], gen: Generation, finish: str | None) -> dict[str, Any]:
        now = time.perf_counter_ns()
        first = gen.first_token_ns or now
        submitted = gen.submitted_ns or self.started_ns
        body.update(done=True, done_reason="length" if finish == "length" else "stop")
        if self.context is not None:
            body["context"] = self.context + list(gen.choices[0].token_ids)
        body.update(total_duration=now - self.started_ns, load_duration=0,
                    prompt_eval_count=gen.prompt_tokens, prompt_eval_duration=first - submitted,
                    eval_count=gen.completion_tokens, eval_duration=(gen.last_token_ns or now) - first)
        return body

    @staticmethod
    def _calls(calls: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
        """Chat tool calls as Ollama's (arguments as objects); one whose arguments are not a JSON
        object (cut short) is given back as text."""
        taken, text = [], ""
        for index, call in enumerate(calls):
            function = call["function"]
            try:
                arguments = strict_json(function["arguments"]) if function["arguments"].strip() else {}
            except ValueError:
                arguments = None
            if isinstance(arguments, dict):
                taken.append({"id": call.get("id"), "function": {"index": index, "name": function["name"],
                                                                 "arguments": arguments}})
            else:
                text += function["arguments"]
        return taken, text

    def whole(self, gen: Generation, fmt: CompletionFormat) -> dict[str, Any]:
        final = fmt.choice_final(gen.choices[0])
        message, finish = final["message"], final["finish_reason"]
        calls, spilled = self._calls(message.get("tool_calls") or [])
        body = self._body((message.get("content") or "") + spilled, calls)
        if final.get("logprobs") is not None:
            body["logprobs"] = final["logprobs"]["content"]
        return self._final(body, gen, finish)

    async def lines(self, gen: Generation, fmt: CompletionFormat,
                    aborted: Callable[[], APIError]) -> AsyncIterator[str]:
        """A line per token of text (with its logprobs when asked), the tool calls once whole, then
        the last line (done, counts, durations); or {"error": ...} if the engine fails the request
        or aborts it before its end."""
        finish: str | None = None
        pending: dict[int, dict[str, Any]] = {}  # tool-call index -> the call as its deltas build it
        async for delta in chat_deltas(gen, fmt):
            for part in delta.calls:
                call = pending.setdefault(part["index"], {"id": None, "function": {"name": "", "arguments": ""}})
                call["id"] = part.get("id") or call["id"]
                function = part.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
            if delta.text or delta.logprobs:
                body = self._body(delta.text)
                if delta.logprobs:
                    body["logprobs"] = delta.logprobs
                yield ndjson({**body, "done": False})
            finish = delta.finish or finish
        if gen.error is not None or finish == "abort":
            error = failure(gen) if gen.error is not None else aborted()
            yield ndjson({"error": error.message})
            return
        if pending:
            calls, spilled = self._calls([pending[i] for i in sorted(pending)])
            yield ndjson({**self._body(spilled, calls), "done": False})
        yield ndjson(self._final(self._body(""), gen, finish))
