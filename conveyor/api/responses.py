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
from fastapi.responses import JSONResponse, StreamingResponse

from conveyor.api.errors import INTERNAL_ERROR, APIError, server_error, unavailable
from conveyor.api.generation import Choice, Generation, TokenLogprob
from conveyor.engine.async_engine import EngineStoppedError
from conveyor.errors import RequestFailedError

log = logging.getLogger("conveyor.api")


def failure(gen: Generation) -> APIError:
    """What the client is told when the engine failed its request: never the exception's text
    (it may hold internals); that goes to the log."""
    error = gen.error
    if isinstance(error, EngineStoppedError):
        return unavailable("the server is shutting down", code="shutting_down")
    log.error("%s failed: %r", gen.id, error)
    if isinstance(error, RequestFailedError):
        return server_error("this request failed inside the engine and was removed from the batch; "
                            "other requests were not affected")
    return server_error(INTERNAL_ERROR)


class CompletionFormat:
    object_name, chunk_object = "text_completion", "text_completion"

    def __init__(self, model: str) -> None:
        self.model = model

    def first_chunks(self, gen: Generation) -> list[dict[str, Any]]:
        return []

    def choice_delta(self, choice: Choice, delta: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        lp = _legacy_logprobs(logprobs) if choice.num_logprobs is not None else None
        return {"index": choice.index, "text": delta, "logprobs": lp, "finish_reason": choice.finish_reason}

    def choice_final(self, choice: Choice) -> dict[str, Any]:
        return self.choice_delta(choice, choice.text, choice.logprobs)


class ChatFormat(CompletionFormat):
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def first_chunks(self, gen: Generation) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [{"index": c.index, "delta": role, "logprobs": None, "finish_reason": None} for c in gen.choices]

    def choice_delta(self, choice: Choice, delta: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        lp = _chat_logprobs(logprobs) if choice.num_logprobs is not None else None
        content = {"content": delta} if delta else {}
        return {"index": choice.index, "delta": content, "logprobs": lp, "finish_reason": choice.finish_reason}

    def choice_final(self, choice: Choice) -> dict[str, Any]:
        lp = _chat_logprobs(choice.logprobs) if choice.num_logprobs is not None else None
        message = {"role": "assistant", "content": choice.text}
        return {"index": choice.index, "message": message, "logprobs": lp, "finish_reason": choice.finish_reason}


def _legacy_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any]:
    entries = entries or []
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t: lp for t, _, lp in e.top} for e in entries],
        "text_offset": [e.text_offset for e in entries],
    }


def _chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token_bytes),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in e.top],
            }
            for e in entries or []
        ]
    }


def usage(gen: Generation) -> dict[str, int]:
    p, c = gen.prompt_tokens, gen.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _envelope(gen: Generation, fmt: CompletionFormat, obj: str, choices: list) -> dict[str, Any]:
    return {"id": gen.id, "object": obj, "created": gen.created, "model": fmt.model, "choices": choices}


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(gen: Generation, fmt: CompletionFormat, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list) -> str:
        body = _envelope(gen, fmt, fmt.chunk_object, choices)
        if include_usage:
            body["usage"] = None
        return _sse(body)

    for first in fmt.first_chunks(gen):
        yield chunk([first])
    async for choice, delta in gen.updates():
        logprobs = choice.take_logprobs()
        if delta or logprobs or choice.finished:
            yield chunk([fmt.choice_delta(choice, delta, logprobs)])
    if gen.error is not None:
        yield _sse(failure(gen).body())
    elif include_usage:
        yield _sse({**_envelope(gen, fmt, fmt.chunk_object, []), "usage": usage(gen)})
    yield _sse("[DONE]")


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close`, however the stream ends (disconnects too)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self.on_close()


def stream_response(gen: Generation, fmt: CompletionFormat, include_usage: bool,
                    on_close: Callable[[], None]) -> SSEResponse:
    return SSEResponse(_events(gen, fmt, include_usage), on_close)


async def full_response(request: Request, gen: Generation, fmt: CompletionFormat) -> JSONResponse | None:
    """Collect the whole answer; None if the client disconnected first (its requests are aborted)."""

    async def collect() -> None:
        async for _ in gen.updates():
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
        return None
    work.result()
    if gen.error is not None:
        raise failure(gen)
    body = _envelope(gen, fmt, fmt.object_name, [fmt.choice_final(c) for c in gen.choices])
    body["usage"] = usage(gen)
    return JSONResponse(body)
