"""The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
from __future__ import annotations

import asyncio
import functools
import hmac
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from conveyor import __version__

from conveyor.api.errors import APIError, bad_request, install_handlers, invalid, unavailable
from conveyor.api.generation import Generation
from conveyor.api.limits import decode_json, max_chars_per_token, read_body
from conveyor.api.metrics import Metrics
from conveyor.api.protocol import ChatCompletionRequest, CompletionRequest, parse
from conveyor.api.schema import (
    V1_ERRORS,
    ChatCompletionResponse,
    CompletionResponse,
    Health,
    ModelList,
    generation_responses,
    install_openapi,
)
from conveyor.api.responses import ChatFormat, CompletionFormat, full_response, stream_response
from conveyor.engine.async_engine import EngineStoppedError, QueueFullError
from conveyor.engine.client import EngineClient
from conveyor.config import DEFAULT_MAX_REQUEST_BYTES
from conveyor.errors import InvalidRequestError

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServerState:
    engine: EngineClient  # a local AsyncEngine, or a Ray deployment (conveyor.distributed)
    model_names: Sequence[str]
    metrics: Metrics
    api_key: str | None = None
    draining: bool = False  # set on SIGTERM: new requests get 503 while in-flight ones finish
    inflight: int = 0  # accepted generations not yet answered
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # bodies past it get 413, unread
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def capacity(self) -> int:
        """Most tokens (prompt + output) one request can hold: the context or the whole KV cache."""
        return self.engine.capacity

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """A text prompt longer than this cannot fit `capacity` tokens whatever it says, so it is
        refused without tokenizing it (None: the tokenizer's vocabulary is unknown)."""
        per_token = max_chars_per_token(self.tokenizer)
        return None if per_token is None else self.capacity * per_token


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.on_report = state.metrics.on_report
        state.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.engine.stop()

    app = FastAPI(title="conveyor", version=__version__, lifespan=lifespan)
    app.state.conveyor = state
    install_handlers(app)

    def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.get("/models", response_model=ModelList, responses=V1_ERRORS)
    async def models() -> dict[str, Any]:
        data = [
            {"id": name, "object": "model", "created": state.created, "owned_by": "conveyor",
             "max_model_len": state.engine.max_model_len}
            for name in state.model_names
        ]
        return {"object": "list", "data": data}

    @v1.post("/completions", responses=generation_responses(CompletionResponse))
    async def completions(request: Request) -> Response:
        data = await _read_json(request, state)
        _check_prompt_sizes(state, data)
        body = parse(CompletionRequest, data)
        _check_model(state, body.model)
        prompts = await asyncio.to_thread(_tokenize_prompts, state, body.prompt)
        params = body.sampling_params(_max_tokens(state, body.max_tokens, prompts, chat=False), body.logprobs)
        gen = Generation(state.engine, state.tokenizer, params, body.logprobs, "cmpl")
        return await _serve(request, state, gen, prompts, CompletionFormat(_name(state, body.model)),
                            bool(body.stream), body.include_usage)

    @v1.post("/chat/completions", responses=generation_responses(ChatCompletionResponse))
    async def chat(request: Request) -> Response:
        body = parse(ChatCompletionRequest, await _read_json(request, state))
        _check_model(state, body.model)
        messages = [m.as_template_input() for m in body.messages]
        _check_chat_size(state, messages)
        prompt = await asyncio.to_thread(_render_chat, state, messages)
        requested = body.max_completion_tokens or body.max_tokens
        params = body.sampling_params(_max_tokens(state, requested, [prompt], chat=True), body.num_logprobs)
        gen = Generation(state.engine, state.tokenizer, params, body.num_logprobs, "chatcmpl")
        return await _serve(request, state, gen, [prompt], ChatFormat(_name(state, body.model)),
                            bool(body.stream), body.include_usage)

    app.include_router(v1)

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> Response:
        if state.draining or not state.engine.is_running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        payload, content_type = state.metrics.render()
        return Response(payload, media_type=content_type)

    install_openapi(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest})
    return app


async def _read_json(request: Request, state: ServerState) -> Any:
    return decode_json(await read_body(request, state.max_request_bytes))


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        served = ", ".join(state.model_names)
        raise APIError(404, f"the model {model!r} does not exist; this server serves: {served}",
                       param="model", code="model_not_found")


def _name(state: ServerState, model: str | None) -> str:
    return model or state.model_names[0]


def _tokenize_prompts(state: ServerState, prompt: str | list) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    out = []
    for p in prompts:
        ids = state.tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise bad_request("the prompt is empty", param="prompt")
        out.append(ids)
    return out


def _check_prompt_sizes(state: ServerState, data: Any) -> None:
    """A 400 in constant time per prompt for one that cannot fit, on the decoded JSON, before it is
    validated, tokenized or copied: a token-id list longer than the capacity, or a text longer
    than the most characters that many tokens can hold."""
    prompt = data.get("prompt") if isinstance(data, dict) else None
    if isinstance(prompt, (str, list)):
        items = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        for item in items:
            if isinstance(item, str):
                limit, unit = state.max_prompt_chars, "characters"
            elif isinstance(item, list):
                limit, unit = state.capacity - 1, "tokens"  # at least one token to generate
            else:
                continue
            if limit is not None and len(item) > limit:
                raise bad_request(f"the prompt ({len(item)} {unit}) cannot fit the maximum model length of "
                                  f"{state.capacity} tokens", param="prompt", code="context_length_exceeded")


def _check_chat_size(state: ServerState, messages: list[dict[str, str]]) -> None:
    limit = state.max_prompt_chars
    size = sum(len(m["content"]) for m in messages)
    if limit is not None and size > limit:
        raise bad_request(f"the messages ({size} characters) cannot fit the maximum model length of "
                          f"{state.capacity} tokens", param="messages", code="context_length_exceeded")


def _render_chat(state: ServerState, messages: list[dict[str, str]]) -> list[int]:
    try:
        text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except (InvalidRequestError, ValueError) as exc:  # ChatTemplateError is a ValueError too
        raise bad_request(str(exc), param="messages") from None
    return state.tokenizer.encode(text)


def _max_tokens(state: ServerState, requested: int | None, prompts: list[list[int]], chat: bool) -> int:
    """The request's max_tokens; by default 16 for completions (OpenAI), and for chat whatever room
    the prompt leaves in the context (vLLM)."""
    if requested is not None:
        return requested
    if not chat:
        return DEFAULT_COMPLETION_MAX_TOKENS
    longest = max(len(p) for p in prompts)
    if longest >= state.capacity:
        raise bad_request(f"the prompt ({longest} tokens) leaves no room to generate within the "
                          f"maximum of {state.capacity} tokens", param="messages")
    return state.capacity - longest


async def _serve(request: Request, state: ServerState, gen: Generation, prompts: list[list[int]],
                 fmt: CompletionFormat, stream: bool, include_usage: bool) -> Response:
    if state.draining:
        state.metrics.rejected("shutting_down").inc()
        raise unavailable("the server is shutting down", code="shutting_down")
    try:
        await gen.submit(prompts)
    except QueueFullError as exc:
        state.metrics.rejected("queue_full").inc()
        raise unavailable(str(exc)) from None
    except EngineStoppedError as exc:
        raise unavailable(str(exc), code="shutting_down") from None
    except InvalidRequestError as exc:
        state.metrics.rejected("invalid").inc()
        raise invalid(exc, isinstance(fmt, ChatFormat)) from None
    state.inflight += 1
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            state.inflight -= 1
            gen.close()

    if stream:
        return stream_response(gen, fmt, include_usage, release)
    try:
        response = await full_response(request, gen, fmt)
    finally:
        release()
    return response if response is not None else Response(status_code=499)
