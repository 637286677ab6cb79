"""llama.cpp's own server API (POST /completion, llama-server's older name, /completions, /infill,
/embedding and /embeddings, the `content` forms of /tokenize and /detokenize, /apply-template and
GET /props), for the clients written against llama-server: its README's examples (`n_predict`,
`content`, `stop_type`, `timings`), scripts and front ends built on them, and the editor plugins
that complete code by fill-in-the-middle (llama.vim, llama.vscode: /infill with `input_extra`,
`n_indent`, `t_max_predict_ms` and the `infill` sampler).

A request is served as the completion it amounts to, through /v1/completions' pipeline, sampled in
llama.cpp's way: its defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05) and its order of
samplers (`samplers`, by name or letter; top-k, top-p and min-p cut the model's own distribution,
temperature comes last: conveyor/sampling/chain.py). A sampler this server does not have (DRY,
XTC, typical-p, mirostat, top-n-sigma, ...) is taken only at the value that turns it off; a
penalty window other than the whole context (`repeat_last_n` -1) or none (0) is refused, and
presence and frequency penalties too (llama.cpp counts them over the prompt as well, OpenAI's over
the output: /v1/completions has those).

`cache_prompt` is taken either way: a prompt's cached prefix computes the same bits here, so it
changes no result, only speed. `t_max_prompt_ms` is taken and not enforced: llama-server lists it
as not implemented and does not read it either (llama.vim and llama.vscode send it). There are no
slots: `id_slot` is -1, and every answer says 0. A null field is one not sent.
"""
from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Literal

from pydantic import AliasChoices, Field, model_validator

from conveyor.api.errors import APIError, bad_request
from conveyor.api.generation import Choice, Generation, TokenLogprob, take_token_ids
from conveyor.api.protocol import Text, _Strict
from conveyor.api.responses import failure
from conveyor.sampling.pooling import EUCLIDEAN, NO_NORM, normalized

# llama-server's default order (common_params_sampling.samplers) and its names' aliases.
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
_CANONICAL = ("dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "infill", "penalties",
              "adaptive_p")
_SAMPLER_NAMES = {
    **{name: name for name in _CANONICAL},
    **{name.replace("_", "-"): name for name in _CANONICAL},
    **{name.replace("_", ""): name for name in _CANONICAL},
    "nucleus": "top_p", "temp": "temperature", "typ": "typ_p",
}
_SAMPLER_LETTERS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                    "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
# The samplers applied here; the others are taken only at the settings that leave them idle.
_APPLIED = ("top_k", "top_p", "min_p", "temperature", "infill")
# llama-server's default logical batch (-b): its /infill takes up to 3/4 of it of the prefix and
# the rest of a quarter of the suffix.
INFILL_BATCH = 2048
# A cut prefix starts on a grid of this many tokens (infill_prompt), so that it moves once every
# this many tokens typed.
PREFIX_GRID = 256
# The sampler's bound on a temperature (SamplingParams; /v1 keeps OpenAI's 2): past it a row is
# as flat as it gets.
MAX_TEMPERATURE = 100.0
# A top_p of 0 keeps the likeliest token alone (llama.cpp's min_keep 1); the engine takes (0, 1].
_KEEP_ONE = 1e-9


class _LlamaRequest(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        """A null is a field not sent (llama-server reads it as its default)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class InputChunk(_Strict):
    """A file's text given as context to /infill (llama.vim and llama.vscode send the chunks they
    gathered, with the time they took each)."""

    text: Text = ""
    filename: Text = "tmp"
    time: float | None = None  # when the client took the chunk: for the client's own bookkeeping


class LlamaCompletionRequest(_LlamaRequest):
    """llama-server's /completion fields (tools/server/README.md)."""

    model: Text | None = None
    prompt: Text | list[Any] = ""
    n_predict: int = Field(-1, ge=-1, validation_alias=AliasChoices("n_predict", "max_tokens", "max_completion_tokens"))
    temperature: float = Field(0.8, ge=0, le=MAX_TEMPERATURE)  # unbounded in llama.cpp; the sampler's bound
    top_k: int = Field(40, ge=0)
    top_p: float = Field(0.95, ge=0, le=1)
    min_p: float = Field(0.05, ge=0, le=1)
    seed: int = -1
    stop: list[Text] | Text = []
    stream: bool = False
    ignore_eos: bool = False
    n_probs: int = Field(0, ge=0, le=20, validation_alias=AliasChoices("n_probs", "logprobs"))
    logit_bias: list[list[Any]] | dict[str, float | bool] | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = Field(64, ge=-1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    samplers: list[Text] | Text | None = None
    json_schema: dict[str, Any] | None = None
    cache_prompt: bool = True
    return_tokens: bool = False
    timings_per_token: bool = False
    response_fields: list[Text] | None = None
    n_indent: int = Field(0, ge=0)
    t_max_predict_ms: int = Field(0, ge=-1)
    t_max_prompt_ms: int | None = None  # taken and not enforced, as llama-server (module docstring)
    # Tokens kept when a full context shifts: a context never shifts here (a prompt that does not
    # fit is refused), so there is nothing to keep; 0 and -1 (all) both hold.
    n_keep: int = Field(0, ge=-1, le=0)
    # Settings of samplers this server does not have, read only when their own switch turns them on.
    dynatemp_exponent: float = 1.0
    xtc_threshold: float = 0.1
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[Text] | None = None
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1

    unsupported = {
        "typical_p": (1, 1.0), "dynatemp_range": (0, 0.0), "xtc_probability": (0, 0.0), "dry_multiplier": (0, 0.0),
        "mirostat": (0,), "top_n_sigma": (-1, -1.0), "min_keep": (0,), "post_sampling_probs": (False,),
        "n_discard": (0,), "n_cache_reuse": (0,), "lora": ([],), "grammar": ("", None), "id_slot": (-1,),
        "n_cmpl": (1,), "n": (1,), "return_progress": (False,), "verbose": (False,), "backend_sampling": (False,),
    }

    @model_validator(mode="after")
    def _penalties(self) -> "LlamaCompletionRequest":
        if self.repeat_penalty != 1.0 and self.repeat_last_n not in (-1, 0):
            raise ValueError(f"repeat_penalty over the last {self.repeat_last_n} tokens (repeat_last_n) is not "
                             "supported: it covers the whole context here (send repeat_last_n -1, or 0 for none)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise ValueError(f"{name} is not supported here (llama.cpp counts it over the prompt too): "
                                 f"/v1/completions takes it over the output, as OpenAI's")
        return self

    @property
    def penalized(self) -> bool:
        return self.repeat_penalty != 1.0 and self.repeat_last_n != 0

    def sampler_chain(self) -> tuple[str, ...]:
        """The steps this request's `samplers` apply here, in order; a refusal names `samplers`.
        Names are read in any case, letters as given (as llama-server reads them)."""
        given = DEFAULT_SAMPLERS if self.samplers is None else self.samplers
        letters = isinstance(self.samplers, str)
        names: list[str] = []
        for item in list(given) if letters else given:
            table = _SAMPLER_LETTERS if letters else _SAMPLER_NAMES
            name = table.get(item if letters else item.lower())
            if name is None:
                known = ", ".join(sorted(table))
                raise bad_request(f"samplers: unknown sampler {item!r} (known: {known})", param="samplers")
            names.append(name)
        chain = tuple(name for name in names if name in _APPLIED)
        if self.penalized:
            if "penalties" not in names:
                raise bad_request("samplers: repeat_penalty is set but the samplers leave out 'penalties'",
                                  param="samplers")
            before = names[:names.index("penalties")]
            if any(name in _APPLIED for name in before):
                raise bad_request("samplers: 'penalties' must come before the samplers that cut or scale the "
                                  "distribution here", param="samplers")
        return chain

    def completion_fields(self) -> dict[str, Any]:
        """What the request asks of /v1/completions' fields (its prompt and length aside): every
        sampling field given, so that llama.cpp's defaults hold, not the model's recommendation."""
        fields: dict[str, Any] = {
            "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p or _KEEP_ONE,
            "min_p": self.min_p, "seed": None if self.seed < 0 or self.seed >= 2**32 - 1 else self.seed,
            "stop": self.stop, "ignore_eos": self.ignore_eos,
            "repetition_penalty": self.repeat_penalty if self.penalized else 1.0,
        }
        if self.json_schema is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema",
                                                                               "schema": self.json_schema}}
        return fields

    def settings(self, n_ctx: int) -> dict[str, Any]:
        """llama.cpp's `generation_settings`: what the request was served with."""
        return {"n_predict": self.n_predict, "seed": self.seed, "temperature": self.temperature,
                "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p, "repeat_last_n": self.repeat_last_n,
                "repeat_penalty": self.repeat_penalty, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "stop": self.stop, "ignore_eos": self.ignore_eos,
                "stream": self.stream, "n_probs": self.n_probs, "n_keep": self.n_keep, "n_indent": self.n_indent,
                "t_max_predict_ms": self.t_max_predict_ms, "timings_per_token": self.timings_per_token,
                "samplers": list(self.sampler_chain()), "n_ctx": n_ctx}


class LlamaInfillRequest(LlamaCompletionRequest):
    """/infill: the code before and after the cursor, other files as context, and `prompt` (text the
    middle starts with)."""

    input_prefix: Text = ""
    input_suffix: Text = ""
    input_extra: list[InputChunk] = []


@dataclass(frozen=True)
class Biases:
    """A llama.cpp logit_bias as this server applies it: /v1/completions' {id: bias}, and the ids
    `false` bans (never sampled, as llama.cpp's -inf bias; the engine masks them)."""

    added: dict[str, float]
    banned: list[int]


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer past float's range
        return False


def bias_entries(body: LlamaCompletionRequest, encode: Callable[[str], list[int]]) -> Biases:
    """llama.cpp's logit_bias ([[token, bias], ...] or {token: bias}; a token as an id or as text,
    each of whose tokens then takes the bias; `false` bans it)."""
    pairs = body.logit_bias.items() if isinstance(body.logit_bias, dict) else (body.logit_bias or [])
    added: dict[str, float] = {}
    banned: dict[int, None] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise bad_request("logit_bias takes [token, bias] pairs", param="logit_bias")
        token, bias = pair
        if bias is not False and (isinstance(bias, bool) or not isinstance(bias, (int, float)) or not _finite(bias)):
            raise bad_request(f"logit_bias: a bias is a finite number or false, got {bias!r}", param="logit_bias")
        if isinstance(token, str) and isinstance(body.logit_bias, dict) and re.fullmatch(r"-?\d+", token):
            ids = [int(token)]  # an object's keys are strings: an integer names a token id
        elif isinstance(token, str):
            ids = encode(token)
        elif isinstance(token, int) and not isinstance(token, bool):
            ids = [token]
        else:
            raise bad_request(f"logit_bias: a token is an id or a text, got {token!r}", param="logit_bias")
        if bias is False:
            banned.update(dict.fromkeys(ids))
        else:
            added.update({str(i): float(bias) for i in ids})
    return Biases(added, list(banned))


def prompt_ids(prompt: str | list[Any], encode: Callable[[str, bool], list[int]], field: str = "prompt") -> list[list[int]]:
    """llama.cpp's prompt shapes as token-id prompts: a text; token ids and texts mixed (one
    prompt); or a list of texts or of such lists (one prompt each). A text that starts a prompt
    takes the model's BOS (`encode(text, first)`). `field`: what a refusal names."""
    def one(item: str | list[Any]) -> list[int]:
        if isinstance(item, str):
            return encode(item, True)
        ids: list[int] = []
        for position, part in enumerate(item):
            if isinstance(part, str):
                ids += encode(part, position == 0)
            elif isinstance(part, int) and not isinstance(part, bool):
                ids.append(part)
            else:
                raise bad_request(f"{field}: an element is a token id or a text, got {part!r}", param=field)
        return ids

    if isinstance(prompt, str):
        return [one(prompt)]
    if not prompt:
        raise bad_request(f"{field} must not be empty", param=field)
    if any(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [one(prompt)]  # ids, perhaps with texts between them
    if all(isinstance(p, (str, list)) for p in prompt):
        return [one(p) for p in prompt]
    raise bad_request(f"{field} is a text, token ids (with texts between them), or a list of those", param=field)


@dataclass(frozen=True)
class InfillFrame:
    """A model's fill-in-the-middle tokens and BOS, as llama.cpp's /infill frames a prompt."""

    prefix: int
    suffix: int
    middle: int
    repo: int | None
    file_separator: int | None
    bos: int | None


def infill_prompt(body: LlamaInfillRequest, frame: InfillFrame, encode: Callable[[str], list[int]],
                  prompt: list[int], n_ctx: int) -> list[int]:
    """llama-server's /infill prompt: the extra files first (the repository-level pattern where the
    model has its tokens, else each after a separator line), then prefix, prompt, suffix and the
    middle token; the prefix keeps its last 3/4 of a batch, the suffix its first quarter less the
    prompt, the extra files (their latest part) what is left of the context after a batch and twice
    the server's n_predict (-1: so 2 more), and, here, never so much that nothing can be written.

    Where the context holds a batch and PREFIX_GRID more, a cut prefix starts on a PREFIX_GRID-token
    grid (keeping up to PREFIX_GRID - 1 tokens more than llama-server, taken from the extra files'
    share): as a client that sends all the text before the cursor types, the cut then moves once
    every PREFIX_GRID tokens rather than with each keystroke, so the prompt's start stays in the
    prefix cache. llama-server keeps its cut exact and moves the cached KV along instead
    (--cache-reuse), which conveyor does not do."""
    extra: list[int] = []
    if frame.repo is not None:
        extra += [frame.repo, *encode("myproject\n")]
    for chunk in body.input_extra:
        if frame.file_separator is not None:
            extra += [frame.file_separator, *encode(chunk.filename + "\n")]
        else:
            extra += encode("\n\n--- snippet ---\n\n")
        extra += encode(chunk.text)
    if frame.file_separator is not None:
        extra += [frame.file_separator, *encode("filename\n")]
    before, after = encode(body.input_prefix), encode(body.input_suffix)
    extra_room = n_ctx - INFILL_BATCH + 2
    start = max(0, len(before) - 3 * (INFILL_BATCH // 4))
    if start > 0 and n_ctx - INFILL_BATCH - PREFIX_GRID - 2 >= 0:
        start -= start % PREFIX_GRID
        # What the grid may add comes out of the extra files' share, whatever this keystroke's cut,
        # so that their part (the prompt's start) stays the same from one keystroke to the next.
        extra_room -= PREFIX_GRID + 4
    before = before[start:]
    after = after[:min(len(after), max(0, INFILL_BATCH // 4 - (2 + len(prompt))))]
    head = [frame.bos] if frame.bos is not None else []
    rest = [*head, frame.prefix, *before, *prompt, frame.suffix, *after, frame.middle]
    take = max(0, min(extra_room, len(extra), n_ctx - 1 - len(rest)))
    return [*extra[len(extra) - take:], *rest]


def _response_fields(body: dict[str, Any], wanted: Sequence[str] | None) -> dict[str, Any]:
    """Only the fields asked for, a path with slashes taken from inside (llama.cpp's
    json_get_nested_values: its key is the path as asked); a path that is not there is left out."""
    if not wanted:
        return body
    out = {}
    for path in wanted:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


class IndentLimit:
    """llama.cpp's n_indent: once a line after the first starts with less indentation than this,
    the generation ends there and that line keeps only its indentation. Text is released as it can
    no longer be cut (a line's leading spaces and tabs wait for what follows them)."""

    def __init__(self, indent: int) -> None:
        self.indent = indent
        self.text = ""  # everything generated so far, as kept
        self.released = 0
        self.hit = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.indent > 0 and not self.hit:
            start = self.text.find("\n") + 1
            while start > 0:
                rest = self.text[start:]
                stripped = rest.lstrip(" \t")
                width = len(rest) - len(stripped)
                if not stripped:
                    break  # the line's indentation so far: wait
                if width < self.indent:
                    self.text, self.hit = self.text[:start + width], True
                    break
                start = self.text.find("\n", start) + 1
        if self.hit or self.indent <= 0:
            ready = len(self.text)
        else:
            last = self.text.rfind("\n")
            ready = len(self.text) if last < 0 or self.text[last + 1:].strip(" \t") else last + 1
        out, self.released = self.text[self.released:ready], max(self.released, ready)
        return out

    def rest(self) -> str:
        out, self.released = self.text[self.released:], len(self.text)
        return out


@dataclass
class LlamaReply:
    """An answer to /completion or /infill, whole or as server-sent events, in llama-server's shapes."""

    body: LlamaCompletionRequest
    model: str
    n_ctx: int
    prompts: list[list[int]]
    prompt_text: Callable[[list[int]], str]
    generates: bool = True
    limits: dict[int, IndentLimit] = field(default_factory=dict)
    stop_types: dict[int, str] = field(default_factory=dict)  # a choice ended here (n_indent, t_max_predict_ms)

    def limit(self, choice: Choice) -> IndentLimit:
        return self.limits.setdefault(choice.index, IndentLimit(self.body.n_indent))

    def timings(self, gen: Generation) -> dict[str, Any]:
        now = time.perf_counter_ns()
        first, submitted = gen.first_token_ns or now, gen.submitted_ns or now
        prompt_n = max(0, gen.prompt_tokens - gen.cached_tokens)
        predicted_n = gen.completion_tokens if self.generates else 0
        prompt_ms, predicted_ms = (first - submitted) / 1e6, ((gen.last_token_ns or first) - first) / 1e6
        return {"cache_n": gen.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
                "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
                "predicted_per_second": 1e3 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0}

    def stop_type(self, choice: Choice) -> tuple[str, str]:
        """(stop_type, stopping_word) of a finished choice."""
        if choice.index in self.stop_types:
            return self.stop_types[choice.index], ""
        if choice.finish_reason == "stop" and isinstance(choice.stop_reason, str):
            return "word", choice.stop_reason
        if choice.finish_reason == "length":
            return "limit", ""
        return "eos", ""

    @staticmethod
    def _probabilities(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        def item(token_id: int | None, text: str, raw: bytes, logprob: float | None) -> dict[str, Any]:
            return {"id": token_id, "token": text, "bytes": list(raw), "logprob": logprob}

        return [{**item(e.token_id, e.token, e.token_bytes, e.logprob),
                 "top_logprobs": [item(i, t, b, lp) for i, (t, b, lp) in zip(e.top_ids or [], e.top or [])]}
                for e in entries]

    def final(self, gen: Generation, choice: Choice, text: str, streamed: bool) -> dict[str, Any]:
        stop_type, word = self.stop_type(choice)
        prompt = self.prompts[choice.index] if choice.index < len(self.prompts) else []
        tokens = list(choice.token_ids) if self.generates else []
        body: dict[str, Any] = {
            "index": choice.index, "content": text, "tokens": tokens if self.body.return_tokens and not streamed else [],
            "id_slot": 0, "stop": True, "model": self.model, "tokens_predicted": len(tokens),
            "tokens_evaluated": len(prompt), "generation_settings": self.body.settings(self.n_ctx),
            "prompt": self.prompt_text(prompt), "has_new_line": "\n" in self.limit(choice).text,
            "truncated": False, "stop_type": stop_type, "stopping_word": word, "tokens_cached": gen.cached_tokens,
            "timings": self.timings(gen),
        }
        if not streamed and self.body.n_probs and self.generates:
            body["completion_probabilities"] = self._probabilities(choice.logprobs)
        return _response_fields(body, self.body.response_fields)

    def whole(self, gen: Generation) -> dict[str, Any] | list[dict[str, Any]]:
        answers = [self.final(gen, c, self.limit(c).text if self.generates else "", streamed=False)
                   for c in gen.choices]
        return answers[0] if len(answers) == 1 else answers

    def _past_time(self, gen: Generation, delta: str) -> bool:
        """llama-server's t_max_predict_ms: past it, the generation ends on a token writing a new line."""
        limit = self.body.t_max_predict_ms
        return (limit > 0 and gen.first_token_ns is not None and "\n" in delta
                and (time.perf_counter_ns() - gen.first_token_ns) / 1e6 > limit)

    async def run(self, gen: Generation) -> AsyncIterator[tuple[Choice, str, list[TokenLogprob]]]:
        """The generation's updates with llama.cpp's own limits applied: text as n_indent releases it,
        and each choice ended (its sample stopped in the engine) where n_indent or t_max_predict_ms ends it."""
        async for choice, delta, entries in gen.updates():
            if choice.index in self.stop_types:
                continue
            limit = self.limit(choice)
            released = limit.feed(delta) if self.generates else ""
            if not choice.finished and (limit.hit or self._past_time(gen, delta)):
                self.stop_types[choice.index] = "limit"
                gen.end_choice(choice, "length")
                if not limit.hit:  # ended on time: the text the detokenizer still held is the answer's too
                    released += limit.feed(choice.detok.finish())
                released += limit.rest()
            elif choice.finished:
                released += limit.rest()
            yield choice, released, entries

    async def events(self, gen: Generation, aborted: Callable[[], APIError]) -> AsyncIterator[str]:
        """A `data:` event per token (its text, its ids, its probabilities when asked), then each
        choice's last with the whole answer's fields; `data: {"error": ...}` if the engine fails
        (llama-server's stream has no [DONE])."""
        async for choice, text, entries in self.run(gen):
            if text or entries:
                chunk: dict[str, Any] = {"index": choice.index, "content": text, "tokens": take_token_ids(choice),
                                         "stop": False, "id_slot": 0, "tokens_predicted": len(choice.token_ids),
                                         "tokens_evaluated": len(self.prompts[choice.index])}
                if self.body.timings_per_token:
                    chunk["timings"] = self.timings(gen)
                if self.body.n_probs and entries:
                    chunk["completion_probabilities"] = self._probabilities(entries)
                yield _event(chunk)
            if choice.finished and (choice.finish_reason != "abort" or choice.index in self.stop_types):
                yield _event(self.final(gen, choice, "", streamed=True))
        if gen.error is not None or any(c.finish_reason == "abort" and c.index not in self.stop_types
                                        for c in gen.choices):
            error = failure(gen) if gen.error is not None else aborted()
            yield _event({"error": {"code": error.status, "message": error.message, "type": error.type}})


def _event(body: dict[str, Any]) -> str:
    return "data: " + json.dumps(body, ensure_ascii=False) + "\n\n"


class LlamaTokenizeRequest(_LlamaRequest):
    """llama-server's /tokenize (told from vLLM's by its `content`)."""

    content: Text
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


def token_entry(token: int, raw: bytes) -> dict[str, Any]:
    """A token with its piece, as llama-server's with_pieces: its text where that is valid UTF-8,
    else its bytes."""
    try:
        return {"id": token, "piece": raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {"id": token, "piece": list(raw)}


class LlamaEmbeddingRequest(_LlamaRequest):
    """llama-server's /embedding and /embeddings (not OpenAI's shape: /v1/embeddings has that): the
    `content` (or `input`) in /completion's prompt shapes, each prompt pooled into one vector and
    scaled by `embd_normalize` (llama.cpp's codes: -1 none, 0 max absolute in int16's range, 1
    taxicab, 2 Euclidean, its default; a p above 2, the p-norm)."""

    model: Text | None = None
    content: Text | list[Any] | None = None
    input: Text | list[Any] | None = None
    embd_normalize: int = Field(EUCLIDEAN, ge=NO_NORM, le=2**31 - 1)  # a C int in llama.cpp
    # llama-server reads it here but answers numbers whatever it says: base64 is /v1/embeddings'.
    encoding_format: Literal["float"] = "float"
    dimensions: int | None = None  # as /v1/embeddings: only the model's own width
    user: Text | None = None  # as /v1/embeddings: taken

    @model_validator(mode="after")
    def _one_input(self) -> "LlamaEmbeddingRequest":
        if self.content is None and self.input is None:
            raise ValueError("content (or input) must be provided")
        if self.content is not None and self.input is not None:
            raise ValueError("content and input are the same field: send one")
        return self

    @property
    def prompt(self) -> Text | list[Any]:
        prompt = self.content if self.content is not None else self.input
        assert prompt is not None  # _one_input
        return prompt

    @property
    def prompt_field(self) -> str:
        return "content" if self.content is not None else "input"


def embedding_entries(vectors: list[list[float]], embd_normalize: int) -> list[dict[str, Any]]:
    """llama-server's answer: one entry a prompt, its pooled vector (normalised) in a list of one,
    where `--pooling none` would list every token's."""
    return [{"index": i, "embedding": [normalized(v, embd_normalize)]} for i, v in enumerate(vectors)]


class ApplyTemplateRequest(_Strict):
    """llama-server's /apply-template: the chat turns rendered by the model's template, not run."""

    messages: list[dict[str, Any]] = Field(min_length=1)
