"""OpenAI response shapes for completions and chat, streamed (SSE) or whole.

A streamed answer is `data: {chunk}` events and a closing `data: [DONE]`; with
`stream_options.include_usage` every chunk carries `"usage": null` and one last chunk with no
choices carries the usage. A client that goes away mid-stream has its requests aborted at once.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from conveyor.api.errors import INTERNAL_ERROR, APIError, bad_request, server_error, unavailable
from conveyor.api.detokenizer import token_text
from conveyor.api.generation import Choice, Generation, TokenLogprob, finite, take_token_ids
from conveyor.errors import EngineStoppedError, NoAllowedTokenError, RequestFailedError

log = logging.getLogger("conveyor.api")


def failure(gen: Generation) -> APIError:
    """What the client is told when the engine failed its request: never the exception's text
    (it may hold internals); that goes to the log."""
    error = gen.error
    if isinstance(error, EngineStoppedError):
        return unavailable("the server is shutting down", code="shutting_down")
    if isinstance(error, NoAllowedTokenError):  # the request's own constraints, its text made by the engine
        return bad_request(str(error), param=error.param, code="no_allowed_token")
    log.error("%s failed: %r", gen.id, error)
    if isinstance(error, RequestFailedError):
        return server_error("this request failed inside the engine and was removed from the batch; "
                            "other requests were not affected")
    return server_error(INTERNAL_ERROR)


class CompletionFormat:
    object_name, chunk_object = "text_completion", "text_completion"
    # Where return_token_ids puts the prompt's ids (vLLM's places): in each choice (completions, one
    # prompt each) or once beside the choices (chat); streamed, with the first chunk.
    prompt_ids_in_choice = True

    def __init__(self, model: str, return_token_ids: bool = False) -> None:
        self.model = model
        self.return_token_ids = return_token_ids

    def with_token_ids(self, body: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        if self.return_token_ids:
            body["token_ids"] = token_ids
        return body

    def choice_delta(self, choice: Choice, delta: str, logprobs: list[TokenLogprob] | None,
                     first: bool = False) -> dict[str, Any] | None:
        lp = _legacy_logprobs(logprobs) if choice.num_logprobs is not None else None
        body = {"index": choice.index, "text": delta, "logprobs": lp, "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}
        return self.with_token_ids(body, take_token_ids(choice))

    def choice_final(self, choice: Choice) -> dict[str, Any]:
        final = self.choice_delta(choice, choice.text, choice.logprobs)
        assert final is not None
        self.with_token_ids(final, list(choice.token_ids))
        if self.return_token_ids:
            final["prompt_token_ids"] = choice.prompt_ids
        if choice.prompt_logprobs is not None:
            final["prompt_logprobs"] = prompt_logprobs(choice)
        return final


class ChatFormat(CompletionFormat):
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"
    prompt_ids_in_choice = False

    def choice_delta(self, choice: Choice, delta: str, logprobs: list[TokenLogprob] | None,
                     first: bool = False) -> dict[str, Any] | None:
        lp = _chat_logprobs(logprobs) if choice.num_logprobs is not None else None
        # The role goes out with the first token, so that a client's TTFT is the first token's.
        message = {"role": "assistant", "content": delta} if first else {"content": delta}
        body = {"index": choice.index, "delta": message, "logprobs": lp, "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}
        return self.with_token_ids(body, take_token_ids(choice))

    def choice_final(self, choice: Choice) -> dict[str, Any]:
        lp = _chat_logprobs(choice.logprobs) if choice.num_logprobs is not None else None
        message = {"role": "assistant", "content": choice.text}
        body = {"index": choice.index, "message": message, "logprobs": lp, "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}
        return self.with_token_ids(body, list(choice.token_ids))


def prompt_logprobs(choice: Choice) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, decoded_token}}."""
    tokenizer = choice.detok.tokenizer
    return [
        None if entry is None else
        {str(t): {"logprob": finite(lp), "decoded_token": token_text(tokenizer, t)} for t, lp in entry.items()}
        for entry in choice.prompt_logprobs or []
    ]


def _legacy_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any]:
    entries = entries or []
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.top is None else _with_chosen(e) for e in entries],
        "text_offset": [e.text_offset for e in entries],
    }


def _with_chosen(entry: TokenLogprob) -> dict[str, float | None]:
    """The top alternatives and the chosen token, as OpenAI's legacy completions always give it
    (so up to logprobs + 1 entries; chat names the chosen token beside its list instead)."""
    top: dict[str, float | None] = {t: lp for t, _, lp in entry.top or []}
    top.setdefault(entry.token, entry.logprob)
    return top


def _chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token_bytes),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in e.top or []],
            }
            for e in entries or []
        ]
    }


def usage(gen: Generation) -> dict[str, Any]:
    p, c = gen.prompt_tokens, gen.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}


def _envelope(gen: Generation, fmt: CompletionFormat, obj: str, choices: list) -> dict[str, Any]:
    return {"id": gen.id, "object": obj, "created": gen.created, "model": fmt.model, "choices": choices}


def sse_event(data: dict[str, Any] | str, event: str | None = None) -> str:
    """One Server-Sent Event; `event` names its type (the Responses API's events are named)."""
    head = "" if event is None else f"event: {event}\n"
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_events(gen: Generation, fmt: CompletionFormat, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list, **extra: Any) -> str:
        body = {**_envelope(gen, fmt, fmt.chunk_object, choices), **extra}
        if include_usage:
            body["usage"] = None
        return sse_event(body)

    started: set[int] = set()  # choices whose first chunk went out
    async for choice, delta, logprobs in gen.updates():  # one chunk per token, its text empty or not
        entry = fmt.choice_delta(choice, delta, logprobs, first=choice.index not in started)
        if entry is None:  # a tool-call format holding text back until the call is whole
            continue
        extra: dict[str, Any] = {}
        if choice.index not in started:
            started.add(choice.index)
            if choice.prompt_logprobs is not None:
                entry["prompt_logprobs"] = prompt_logprobs(choice)
            if fmt.return_token_ids and fmt.prompt_ids_in_choice:
                entry["prompt_token_ids"] = choice.prompt_ids
            elif fmt.return_token_ids and len(started) == 1:  # chat: once, with the stream's first chunk
                extra["prompt_token_ids"] = choice.prompt_ids
        yield chunk([entry], **extra)
    if gen.error is not None:
        yield sse_event(failure(gen).body())
    elif include_usage:
        yield sse_event({**_envelope(gen, fmt, fmt.chunk_object, []), "usage": usage(gen)})
    yield sse_event("[DONE]")


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close`, however the stream ends (disconnects too);
    Server-Sent Events, or another `media_type` (Ollama's API streams newline-delimited JSON)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 media_type: str = "text/event-stream") -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type=media_type, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self.on_close()


def whole_body(gen: Generation, fmt: CompletionFormat) -> dict[str, Any]:
    """The answer of a generation run to its end (not streamed)."""
    body = _envelope(gen, fmt, fmt.object_name, [fmt.choice_final(c) for c in gen.choices])
    if isinstance(fmt, ChatFormat) and gen.choices and gen.choices[0].prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs(gen.choices[0])  # vLLM: once, beside the choices
    if not fmt.prompt_ids_in_choice and fmt.return_token_ids and gen.choices:
        body["prompt_token_ids"] = gen.choices[0].prompt_ids
    body["usage"] = usage(gen)
    return body


async def run_to_end(request: Request, gen: Generation, updates: AsyncIterator[Any] | None = None) -> bool:
    """Run every choice to its end (through `updates`, a consumer of gen.updates(), where given), or
    raise the engine's failure; False if the client disconnected first (its requests are then aborted)."""

    async def collect() -> None:
        async for _ in updates if updates is not None else gen.updates():
            pass

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            task.cancel()
    if not work.done() or work.cancelled():
        gen.close()
        return False
    work.result()
    if gen.error is not None:
        raise failure(gen)
    return True
