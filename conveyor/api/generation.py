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
from typing import Any, AsyncIterator, Sequence

from conveyor.api.detokenizer import IncrementalDetokenizer, token_bytes, token_text
from conveyor.engine.async_engine import Aborted, Failed
from conveyor.engine.client import EngineClient
from conveyor.engine.outputs import RequestOutput
from conveyor.sampling.params import SamplingParams

_NEG_INF_LOGPROB = -9999.0  # what OpenAI sends for a token of probability 0 (JSON has no -inf)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _NEG_INF_LOGPROB


@dataclass
class TokenLogprob:
    token: str
    token_bytes: bytes
    logprob: float
    top: list[tuple[str, bytes, float]]  # the top-k alternatives, best first
    text_offset: int


@dataclass
class Choice:
    index: int
    detok: IncrementalDetokenizer
    num_logprobs: int | None
    text: str = ""  # what has been released so far
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    _logprobs_taken: int = 0
    _token_ids_taken: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: RequestOutput) -> str:
        tokenizer = self.detok.tokenizer
        step_logprobs = getattr(out, "logprobs", None)
        self.token_ids.extend(out.new_token_ids)
        for i, token in enumerate(out.new_token_ids):
            offset = len(self.detok.text)
            self.detok.add([token])
            if self.num_logprobs is not None and step_logprobs and i < len(step_logprobs):
                self.logprobs.append(_entry(tokenizer, token, step_logprobs[i], self.num_logprobs, offset))
        self.num_tokens = len(out.token_ids)
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"
            delta = self.detok.finish(out.text)
        else:
            delta = self.detok.release()
        self.text += delta
        return delta

    def abort(self) -> str:
        self.finish_reason = "abort"
        delta = self.detok.finish(None)
        self.text += delta
        return delta

    def take_token_ids(self) -> list[int]:
        new, self._token_ids_taken = self.token_ids[self._token_ids_taken :], len(self.token_ids)
        return new

    def take_logprobs(self) -> list[TokenLogprob]:
        new, self._logprobs_taken = self.logprobs[self._logprobs_taken :], len(self.logprobs)
        return new


def _entry(tokenizer: Any, token: int, logprobs: dict[int, float], k: int, offset: int) -> TokenLogprob:
    ranked = sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:k]
    top = [(token_text(tokenizer, t), token_bytes(tokenizer, t), _finite(lp)) for t, lp in ranked]
    chosen = logprobs.get(token, float("-inf"))
    return TokenLogprob(token_text(tokenizer, token), token_bytes(tokenizer, token), _finite(chosen), top, offset)


class Generation:
    def __init__(self, engine: EngineClient, tokenizer: Any, params: SamplingParams, num_logprobs: int | None,
                 prefix: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.params = params
        self.n = getattr(params, "n", 1)
        self.num_logprobs = num_logprobs
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sink: asyncio.Queue = asyncio.Queue()
        self.request_ids: list[str] = []
        self.choices: list[Choice] = []
        self.prompt_tokens = 0
        self._cached_tokens: dict[int, int] = {}  # prompt index -> its tokens served from the prefix cache
        self.error: BaseException | None = None
        self._prompt_of: dict[str, int] = {}
        self._closed = False

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

    async def submit(self, prompts: Sequence[list[int]]) -> None:
        """Hand every prompt to the engine; if one is refused, abort the others and re-raise."""
        arrival = time.perf_counter()
        try:
            for i, prompt in enumerate(prompts):
                request_id = f"{self.id}-{i}"
                self._prompt_of[request_id] = i
                self.request_ids.append(request_id)
                await self.engine.add_request(request_id, prompt, self.params, self.sink, arrival)
                self.prompt_tokens += len(prompt)
                for j in range(self.n):
                    stop = self.params.stop
                    self.choices.append(Choice(i * self.n + j, IncrementalDetokenizer(self.tokenizer, stop),
                                               self.num_logprobs))
        except BaseException:
            self.close()
            raise

    async def updates(self) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, new text) for every change, until every choice has finished or the engine fails."""
        while not self.done:
            event = await self.sink.get()
            first = self._prompt_of[event.request_id] * self.n
            if isinstance(event, RequestOutput):
                self._cached_tokens[first] = event.num_cached_tokens
                choice = self.choices[first + getattr(event, "index", 0)]
                if not choice.finished:
                    yield choice, choice.update(event)
            elif isinstance(event, Failed):
                self.error = event.error
            elif isinstance(event, Aborted):
                for choice in self.choices[first : first + self.n]:
                    if not choice.finished:
                        yield choice, choice.abort()

    def close(self) -> None:
        """Abort whatever has not finished (the client went away, or an error); idempotent."""
        if self._closed:
            return
        self._closed = True
        for i, request_id in enumerate(self.request_ids):
            mine = self.choices[i * self.n : (i + 1) * self.n]
            if mine and not all(c.finished for c in mine):
                self.engine.abort(request_id)
