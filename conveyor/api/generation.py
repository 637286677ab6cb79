"""One HTTP generation: an engine request per prompt, n samples (choices) each, read as updates.

Choice `i * n + j` is sample j of prompt i, as OpenAI numbers them. Text is detokenised here, on
the event loop, never on the engine's loop thread.
"""
from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

from conveyor.api.detokenizer import token_bytes, token_text
from conveyor.engine.async_engine import Aborted, Failed
from conveyor.engine.client import EngineClient
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.engine.outputs import RequestOutput
from conveyor.errors import InvalidRequestError
from conveyor.sampling.params import SamplingParams

_NEG_INF_LOGPROB = -9999.0  # what OpenAI sends for a token of probability 0 (JSON has no -inf)


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _NEG_INF_LOGPROB


@dataclass
class TokenLogprob:
    token: str
    token_bytes: bytes
    logprob: float | None  # None only for an echoed prompt's first token (nothing precedes it)
    top: list[tuple[str, bytes, float]] | None  # the top-k alternatives, best first
    text_offset: int
    token_id: int | None = None  # and the ids of the token and its alternatives (llama.cpp's API names them)
    top_ids: list[int] | None = None


@dataclass
class Choice:
    index: int
    detok: IncrementalDetokenizer
    num_logprobs: int | None
    text: str = ""  # what has been released so far
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    logprobs: list[TokenLogprob] = field(default_factory=list)
    echo: str = ""  # completions with echo: the prompt's text, released before the first token's
    echo_ids: list[int] = field(default_factory=list)  # and its token ids, to echo their logprobs
    prompt_ids: list[int] = field(default_factory=list)  # the prompt's token ids (vLLM's return_token_ids)
    # vLLM's prompt_logprobs: {token id: logprob} per prompt token (None for the first).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    _started: bool = False
    token_ids: list[int] = field(default_factory=list)  # every generated token, for return_token_ids
    _token_ids_taken: int = 0
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens named "token_id:N"
    generates: bool = True  # False: echo with max_tokens 0, the prompt alone (its one token left out)
    embedding: list[float] | None = None  # an embedding request's vector, once it has finished

    def _token_name(self, token: int) -> str:
        return f"token_id:{token}" if self.tokens_as_ids else token_text(self.detok.tokenizer, token)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Tokens of this output: those after a stop string's last one do not count."""
        return len(self.detok.token_ids)

    @property
    def stopped_by_string(self) -> bool:
        return self.detok.stopped

    def update(self, out: RequestOutput) -> list[tuple[str, list[TokenLogprob]]]:
        """(text delta, logprob entries) per new token, so a stream sends one chunk per token; a
        delta is empty while its token's text is held back (part of a character, or maybe the
        start of a stop string). Ends the choice at a stop string, or when the engine says so."""
        tokenizer = self.detok.tokenizer
        step_logprobs = getattr(out, "logprobs", None)
        pieces: list[tuple[str, list[TokenLogprob]]] = []
        entries: list[TokenLogprob] = []
        prefix = ""
        if not self._started:
            self._started, prefix = True, self.echo
            self.prompt_logprobs = getattr(out, "prompt_logprobs", None)
            if self.echo_ids and self.num_logprobs is not None:
                entries = _echo_entries(tokenizer, self._token_name, self.echo_ids, self.prompt_logprobs,
                                        self.num_logprobs)
        if not self.generates:
            self.finish_reason = "length"  # as OpenAI ends a completion of max_tokens 0
            self.text += prefix
            self.logprobs.extend(entries)
            return [(prefix, entries)]
        self.token_ids.extend(out.new_token_ids)
        last = len(out.new_token_ids) - 1
        for i, token in enumerate(out.new_token_ids):
            offset = len(self.echo) + len(self.detok.text)
            self.detok.add([token], ends_on_stop_token=i == last and out.ended_on_stop_token)
            if self.num_logprobs is not None and step_logprobs and i < len(step_logprobs):
                entries.append(_entry(tokenizer, self._token_name, token, step_logprobs[i], self.num_logprobs, offset))
            if self.detok.stopped:
                self.finish_reason, self.stop_reason = "stop", self.detok.stop_reason
            elif out.finished and i == last:
                self.finish_reason, self.stop_reason = out.finish_reason or "stop", out.stop_reason
            pieces.append((self.detok.finish() if self.finished else self.detok.release(), entries))
            entries = []
            if self.finished:
                break
        if not self.finished and out.finished:  # an end without a new token (an embedding's only output)
            self.finish_reason, self.stop_reason = out.finish_reason or "stop", out.stop_reason
            self.embedding = getattr(out, "embedding", None)
            pieces.append((self.detok.finish(), entries))
        if prefix:
            pieces[0] = (prefix + pieces[0][0], pieces[0][1]) if pieces else (prefix, [])
        for delta, new_entries in pieces:
            self.text += delta
            self.logprobs.extend(new_entries)
        return pieces

    def abort(self) -> str:
        self.finish_reason = "abort"
        delta = self.detok.finish()
        self.text += delta
        return delta


def _echo_entries(tokenizer: Any, name: Callable[[int], str], ids: list[int],
                  prompt_logprobs: list[dict[int, float] | None] | None, k: int) -> list[TokenLogprob]:
    """Logprob entries of an echoed prompt (OpenAI: the first token has none), offsets into its text."""
    entries, offset, pending = [], 0, b""
    for position, token in enumerate(ids):
        scored = prompt_logprobs[position] if prompt_logprobs and position < len(prompt_logprobs) else None
        if scored is None:
            entries.append(TokenLogprob(name(token), token_bytes(tokenizer, token), None, None, offset))
        else:
            entries.append(_entry(tokenizer, name, token, scored, k, offset))
        pending += entries[-1].token_bytes
        try:  # a character whose bytes span tokens counts once it is whole
            offset, pending = offset + len(pending.decode("utf-8")), b""
        except UnicodeDecodeError:
            pass
    return entries


def take_token_ids(choice: Choice) -> list[int]:
    """The choice's token ids not handed out yet (return_token_ids streams them chunk by chunk)."""
    new, choice._token_ids_taken = choice.token_ids[choice._token_ids_taken :], len(choice.token_ids)
    return new


def _entry(tokenizer: Any, name: Callable[[int], str], token: int, logprobs: dict[int, float], k: int,
           offset: int) -> TokenLogprob:
    """`name`: how a token is named in the response (its text, or "token_id:N")."""
    ranked = sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:k]
    top = [(name(t), token_bytes(tokenizer, t), finite(lp)) for t, lp in ranked]
    chosen = logprobs.get(token, float("-inf"))
    return TokenLogprob(name(token), token_bytes(tokenizer, token), finite(chosen), top, offset, token,
                        [t for t, _ in ranked])


class Generation:
    def __init__(self, engine: EngineClient, tokenizer: Any, params: SamplingParams, num_logprobs: int | None,
                 prefix: str, tokens_as_ids: bool = False, request_id: str | None = None,
                 generates: bool = True) -> None:
        """`request_id`: the caller's (vLLM's field), else a random one; the response's id is
        `{prefix}-{request_id}` and the engine's requests are named after it. `generates` False:
        the choices answer with the prompt alone (echo with max_tokens 0)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.params = params
        self.n = getattr(params, "n", 1)
        self.num_logprobs = num_logprobs
        self.tokens_as_ids = tokens_as_ids
        self.generates = generates
        self.id = f"{prefix}-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sink: asyncio.Queue = asyncio.Queue()
        self.request_ids: list[str] = []
        self.choices: list[Choice] = []
        self.prompt_tokens = 0
        self._cached_tokens: dict[int, int] = {}  # prompt index -> its tokens served from the prefix cache
        self.error: BaseException | None = None
        self._prompt_of: dict[str, int] = {}
        self._closed = False
        # time.perf_counter_ns() when the prompts were handed over, the first token came and the
        # latest did: the durations Ollama's API reports (prompt evaluation, then generation).
        self.submitted_ns: int | None = None
        self.first_token_ns: int | None = None
        self.last_token_ns: int | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache (OpenAI's prompt_tokens_details)."""
        return sum(self._cached_tokens.values())

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices) or self.error is not None

    async def submit(self, prompts: Sequence[list[int]], echo: Sequence[str] | None = None) -> None:
        """Hand every prompt to the engine at once (the engine takes them in one iteration, not one
        a step); if one is refused, abort the others and re-raise. `echo`: the prompts' texts, to
        come before each choice's output (completions' echo)."""
        arrival = time.perf_counter()
        self.submitted_ns = time.perf_counter_ns()
        try:
            for i, prompt in enumerate(prompts):
                request_id = f"{self.id}-{i}"
                self._prompt_of[request_id] = i
                self.request_ids.append(request_id)
                for j in range(self.n):
                    p = self.params
                    detok = IncrementalDetokenizer(self.tokenizer, p.stop, getattr(p, "include_stop_str_in_output", False),
                                                   getattr(p, "skip_special_tokens", True), getattr(p, "min_tokens", 0))
                    choice = Choice(i * self.n + j, detok, self.num_logprobs, tokens_as_ids=self.tokens_as_ids,
                                    generates=self.generates, prompt_ids=prompt)
                    if echo is not None:
                        choice.echo, choice.echo_ids = echo[i], list(prompt)
                    self.choices.append(choice)
            added = await asyncio.gather(*(self.engine.add_request(request_id, prompt, self.params, self.sink, arrival)
                                           for request_id, prompt in zip(self.request_ids, prompts)),
                                         return_exceptions=True)
            refusals = [result for result in added if isinstance(result, BaseException)]
            if refusals:
                # Only this request's own: an id refused as in use names another's. A refusal that
                # retrying cannot mend (InvalidRequestError) is the one told.
                self._closed = True
                for request_id, result in zip(self.request_ids, added):
                    if result is None:
                        self.engine.abort(request_id)
                raise next((r for r in refusals if isinstance(r, InvalidRequestError)), refusals[0])
            self.prompt_tokens = sum(len(prompt) for prompt in prompts)
        except BaseException:
            self.close()
            raise

    async def updates(self) -> AsyncIterator[tuple[Choice, str, list[TokenLogprob]]]:
        """(choice, new text, new logprob entries) per generated token and for an abort, until every
        choice has finished or the engine fails."""
        while not self.done:
            event = await self.sink.get()
            first = self._prompt_of[event.request_id] * self.n
            if isinstance(event, RequestOutput):
                self._cached_tokens[first] = event.num_cached_tokens
                choice = self.choices[first + getattr(event, "index", 0)]
                if choice.finished:
                    continue
                if event.new_token_ids:
                    self.last_token_ns = time.perf_counter_ns()
                    if self.first_token_ns is None:
                        self.first_token_ns = self.last_token_ns
                for delta, entries in choice.update(event):
                    yield choice, delta, entries
                if choice.stopped_by_string:  # the engine keeps no sample past its stop string
                    self.engine.stop_sample(event.request_id, getattr(event, "index", 0), choice.detok.stop_reason)
            elif isinstance(event, Failed):
                self.error = event.error
            elif isinstance(event, Aborted):
                for choice in self.choices[first : first + self.n]:
                    if not choice.finished:
                        yield choice, choice.abort(), []

    def end_choice(self, choice: Choice, finish_reason: str, stop_reason: str | None = None) -> None:
        """End one choice here, where the front end decided it (a limit of its own API): the engine
        ends its sample as stopped and frees its KV, as at a stop string, and later events of it
        are not read."""
        choice.finish_reason, choice.stop_reason = finish_reason, stop_reason
        self.engine.stop_sample(self.request_ids[choice.index // self.n], choice.index % self.n, stop_reason)

    def close(self) -> None:
        """Abort whatever has not finished (the client went away, or an error); idempotent."""
        if self._closed:
            return
        self._closed = True
        for i, request_id in enumerate(self.request_ids):
            mine = self.choices[i * self.n : (i + 1) * self.n]
            if mine and not all(c.finished for c in mine):
                self.engine.abort(request_id)
