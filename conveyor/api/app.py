"""The FastAPI app: /v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings,
Anthropic's /v1/messages, /v1/models, Ollama's /api/..., llama.cpp's /completion, /infill and /embedding,
/tokenize, /detokenize, /version, /health, /metrics."""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import hashlib
import hmac
import logging
import struct
import sys
import time
import uuid
from collections.abc import Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence, cast

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from conveyor import __version__
from conveyor.api.errors import APIError, bad_request, install_handlers, invalid, server_error, unavailable
from conveyor.api.generation import Generation
from conveyor.api.detokenizer import token_bytes
from conveyor.api.limits import decode_json, max_chars_per_token, read_body
from conveyor.api.metrics import Metrics
from conveyor.api.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, TokenizeChatRequest,
    TokenizeCompletionRequest, parse,
)
from conveyor.api.schema import (
    GENERATION_ERRORS,
    TOKENIZER_ERRORS,
    V1_ERRORS,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    AnthropicReply,
    DeletedResponse,
    EmbeddingResponse,
    Health,
    RESPONSE_ERRORS,
    ResponseObject,
    TokenCount,
    METRICS_RESPONSES,
    OLLAMA_ERRORS,
    MODEL_ERRORS,
    ModelCard,
    ModelList,
    ServedLimits,
    TokenizeResponse,
    Version,
    generation_responses,
    install_openapi,
)
from conveyor.api.chat_translation import renamed
from conveyor.api.anthropic_messages import CHAT_FIELDS as MESSAGES_CHAT_FIELDS
from conveyor.api.anthropic_messages import CountTokensRequest, MessageBuilder, MessagesRequest
from conveyor.api.llama_cpp import (
    ApplyTemplateRequest, InfillFrame, LlamaCompletionRequest, LlamaEmbeddingRequest, LlamaInfillRequest, LlamaReply,
    LlamaTokenizeRequest, bias_entries, embedding_entries, infill_prompt, prompt_ids, token_entry,
)
from conveyor.api.ollama import (
    CHAT_FIELDS as OLLAMA_CHAT_FIELDS, GENERATE_FIELDS as OLLAMA_GENERATE_FIELDS, OLLAMA_API_VERSION,
    OllamaChatRequest, OllamaEmbedRequest, OllamaGenerateRequest, OllamaLegacyEmbedRequest, OllamaPullRequest,
    OllamaReply, OllamaShowRequest, details, model_info, modified_at, ndjson, ollama_parameters, served_name,
)
from conveyor.api.openai_responses import (
    CHAT_FIELDS as RESPONSES_CHAT_FIELDS, ResponseBuilder, ResponsesRequest, ResponseStore, StoredResponse, deleted,
    not_stored, turn_starts,
)
from conveyor.api.responses import (
    ChatFormat, CompletionFormat, SSEResponse, run_to_end, stream_events, whole_body,
)
from conveyor.api.structured import compile_grammar, requested_grammar
from conveyor.api.tools import ToolCallFormat, ToolPlan, plan_tools
from conveyor.engine.client import EngineClient
from conveyor.errors import CONTEXT_LENGTH_EXCEEDED, EngineStoppedError, InvalidRequestError, QueueFullError
from conveyor.sampling.params import SamplingParams
from conveyor.config import (
    DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_STORED_RESPONSES, DEFAULT_MAX_STORED_RESPONSES_BYTES,
)

log = logging.getLogger("conveyor.server")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServerState:
    engine: EngineClient  # a local AsyncEngine, or a Ray deployment (conveyor.distributed)
    model_names: Sequence[str]
    metrics: Metrics
    api_key: str | None = None
    # Origins a browser page may call from (CORS; vLLM's --allowed-origins, default any); empty: none.
    allowed_origins: Sequence[str] = ("*",)
    draining: bool = False  # set on SIGTERM: new requests get 503 while in-flight ones finish
    aborting: bool = False  # set when the drain's grace is over and in-flight requests are aborted
    # Requests being handed to the engine or answered, which a drain waits for (an embeddings
    # request also holds one for its whole span, across its waves).
    inflight: int = 0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # bodies past it get 413, unread
    created: int = field(default_factory=lambda: int(time.time()))
    # The engine's configuration, where the front end knows it: stated in /openapi.json.
    max_num_seqs: int | None = None
    priority_scheduling: bool | None = None
    # What requests that leave a sampling field out get (--generation-config; SamplingParams' names).
    sampling_defaults: Mapping[str, float | int] = field(default_factory=dict)
    # vLLM's --enable-log-requests: each request's prompts and sampling parameters logged as it is
    # handed to the engine, each prompt cut to max_log_len tokens and characters (None: whole).
    log_requests: bool = False
    max_log_len: int | None = None
    # /v1/responses kept for previous_response_id and GET (--max-stored-responses; 0: none).
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(DEFAULT_MAX_STORED_RESPONSES,
                                                                           DEFAULT_MAX_STORED_RESPONSES_BYTES))
    model_digest: str | None = None  # the served file's sha256 (Ollama's /api/tags), once read
    digest_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

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
        # Scans the vocabulary: here, not inside the first request.
        log.debug("text prompts over %s characters are refused untokenized", state.max_prompt_chars)
        try:
            yield
        finally:
            state.engine.stop()

    app = FastAPI(title="conveyor", version=__version__, lifespan=lifespan)
    app.state.conveyor = state
    install_handlers(app)
    if state.allowed_origins:  # added last, so outermost: errors and preflights get its headers too
        # No credentials (cookies): a client authenticates with its bearer key, a header allowed here.
        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"])

    async def check_key(request: Request) -> None:  # async: a sync dependency costs a thread-pool hop
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send the key alone, in x-api-key
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    def card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "conveyor",
                "max_model_len": state.engine.max_model_len}

    @v1.get("/models", response_model=ModelList, responses=V1_ERRORS)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(name) for name in state.model_names]}

    @v1.get("/models/{model:path}", response_model=ModelCard, responses=MODEL_ERRORS)
    async def model(model: str) -> dict[str, Any]:
        """OpenAI's retrieve-model endpoint (a path: served names may hold slashes)."""
        _check_model(state, model)
        return card(model)

    @v1.post("/completions", responses=generation_responses(CompletionResponse))
    async def completions(request: Request) -> Response:
        data = await _read_json(request, state)
        _check_prompt_sizes(state, data)
        body = parse(CompletionRequest, data)
        _check_model(state, body.model)
        echo_only = body.max_tokens == 0  # the engine makes one token, which the answer leaves out (vLLM's way)
        prompts, params = await _completion_params(state, body, 1 if echo_only else body.max_tokens, body.logprobs)
        if body.num_prompt_logprobs != body.prompt_logprobs:
            params = dataclasses.replace(params, prompt_logprobs=body.num_prompt_logprobs)
        echo_source = body.prompt if body.truncate_prompt_tokens is None else prompts  # truncated: decode them
        echo = await asyncio.to_thread(_echo_texts, state, echo_source, prompts) if body.echo else None
        gen = Generation(state.engine, state.tokenizer, params, body.logprobs, "cmpl",
                         bool(body.return_tokens_as_token_ids), body.request_id, generates=not echo_only)
        return await _serve(request, state, gen, prompts,
                            CompletionFormat(_name(state, body.model), bool(body.return_token_ids)),
                            bool(body.stream), body.include_usage, echo)

    @v1.post("/embeddings", response_model=EmbeddingResponse, responses=GENERATION_ERRORS)
    async def embeddings(request: Request) -> Response:
        """OpenAI's embeddings: each input's final hidden states pooled into one vector
        (conveyor/sampling/pooling.py), its prompt computed like any other in the running batch."""
        data = await _read_json(request, state)
        _check_prompt_sizes(state, data, "input", generates=False)
        body = parse(EmbeddingRequest, data)
        _check_model(state, body.model)
        pooling = state.engine.default_pooling
        _check_dimensions(state, body.dimensions)
        if body.normalize is not None:
            pooling = dataclasses.replace(pooling, normalize=body.normalize)
        prompts = await asyncio.to_thread(_tokenize_prompts, state, body.input, body.add_special_tokens, "input")
        prompts = _truncate(state, prompts, body.truncate_prompt_tokens, generates=False)
        _check_inputs_fit(state, prompts, "input")
        params = SamplingParams.for_pooling(pooling, body.priority or 0, body.cache_salt)
        request_id = body.request_id or uuid.uuid4().hex
        vectors = await _embed(request, state, prompts, params, request_id)
        if vectors is None:
            return Response(status_code=499)
        tokens = sum(len(p) for p in prompts)
        return JSONResponse({
            "id": f"embd-{request_id}", "object": "list", "created": int(time.time()), "model": _name(state, body.model),
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @v1.post("/chat/completions", responses=generation_responses(ChatCompletionResponse))
    async def chat(request: Request) -> Response:
        body = parse(ChatCompletionRequest, await _read_json(request, state))
        gen, prompt, fmt = await _chat_generation(state, body, "chatcmpl")
        return await _serve(request, state, gen, [prompt], fmt, bool(body.stream), body.include_usage)

    @v1.post("/responses", responses=generation_responses(ResponseObject))
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API, served as the chat it is (conveyor/api/openai_responses.py)."""
        body = parse(ResponsesRequest, await _read_json(request, state))
        store = state.responses
        if body.store is True and not store.keeps:
            raise bad_request("store: this server keeps no responses (--max-stored-responses or its -memory is 0); "
                              "send store: false", param="store")
        earlier = store.conversation(body.previous_response_id) if body.previous_response_id else []
        hex_id = uuid.uuid4().hex
        response_id = f"resp_{hex_id}"  # never the caller's request_id: a stored response must not be overwritten
        gen, prompt, fmt = await _responses_generation(state, body, earlier, body.request_id or hex_id)
        builder = ResponseBuilder(body, response_id, _name(state, body.model), gen.params.temperature,
                                  gen.params.top_p, stored=body.store is not False and store.keeps)

        def keep(response: dict[str, Any]) -> None:
            """Store it, and say in it whether it was (one past the byte budget alone is not)."""
            if builder.stored and not store.put(response_id, StoredResponse.of(response, earlier, body.items)):
                log.warning("%s: not stored, larger than --max-stored-responses-memory", response_id)
                response["store"] = False

        def whole() -> dict[str, Any]:
            if gen.choices[0].finish_reason == "abort":  # the drain's grace ran out: not an answer to keep
                raise _aborted(state)
            response = builder.whole(gen, fmt)
            keep(response)
            return response

        events = builder.events(gen, fmt, keep, lambda: _aborted(state)) if body.stream else None
        try:
            return await _answer(request, state, gen, [prompt], events, whole, prompt_field="input")
        except APIError as exc:
            raise renamed(exc, RESPONSES_CHAT_FIELDS) from None

    @v1.post("/messages", responses=generation_responses(AnthropicReply))
    async def anthropic_messages(request: Request) -> Response:
        """Anthropic's Messages API, served as the chat it is (conveyor/api/anthropic_messages.py)."""
        body = parse(MessagesRequest, await _read_json(request, state))
        gen, prompt, fmt = await _messages_generation(state, body)
        builder = MessageBuilder(_name(state, body.model))

        def whole() -> dict[str, Any]:
            if gen.choices[0].finish_reason == "abort":
                raise _aborted(state)
            return builder.whole(gen, fmt)

        events = builder.events(gen, fmt, lambda: _aborted(state)) if body.stream else None
        try:
            return await _answer(request, state, gen, [prompt], events, whole, prompt_field="messages")
        except APIError as exc:
            raise renamed(exc, MESSAGES_CHAT_FIELDS) from None

    @v1.post("/messages/count_tokens", response_model=TokenCount, responses=TOKENIZER_ERRORS)
    async def anthropic_count_tokens(request: Request) -> dict[str, Any]:
        """The input tokens a /v1/messages request would take (max_tokens not needed)."""
        body = parse(CountTokensRequest, await _read_json(request, state))
        try:
            chat = parse(ChatCompletionRequest, body.chat_body(uuid.uuid4().hex))
            _check_model(state, chat.model)
            tools = plan_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
            prompt = await asyncio.to_thread(_chat_prompt, state, chat, tools)
        except APIError as exc:
            raise renamed(exc, MESSAGES_CHAT_FIELDS, body.chat_messages()[1]) from None
        return {"input_tokens": len(prompt)}

    @v1.get("/responses/{response_id}", response_model=ResponseObject, responses=RESPONSE_ERRORS)
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        for name in request.query_params:  # OpenAI's stream / starting_after replay a background run's events
            raise bad_request(f"{name} is not supported by this server: a stored response is returned whole",
                              param=name, code="unsupported_parameter")
        stored = state.responses.get(response_id)
        if stored is None:
            raise not_stored(response_id)
        return stored.body

    @v1.delete("/responses/{response_id}", response_model=DeletedResponse, responses=RESPONSE_ERRORS)
    async def delete_response(response_id: str) -> dict[str, Any]:
        if not state.responses.delete(response_id):
            raise not_stored(response_id)
        return deleted(response_id)

    app.include_router(v1)

    # Ollama's API (conveyor/api/ollama.py), for the clients written against Ollama.
    # Not in /openapi.json: Ollama publishes no schema of its own, and its clients read none.
    api = APIRouter(prefix="/api", dependencies=[Depends(check_key)], include_in_schema=False)

    @api.post("/chat", responses=OLLAMA_ERRORS)
    async def ollama_chat(request: Request) -> Response:
        body = parse(OllamaChatRequest, await _read_json(request, state))
        name = _ollama_model(state, body.model)
        reply = OllamaReply(body.model, chat=True)
        if not body.messages:  # Ollama's way to load a model: it is loaded already
            return JSONResponse(reply.loaded())
        try:
            chat = parse(ChatCompletionRequest, {**body.chat_body(uuid.uuid4().hex), "model": name})
            gen, prompt, fmt = await _chat_generation(state, chat, "ollama")
        except APIError as exc:
            raise renamed(exc, OLLAMA_CHAT_FIELDS) from None
        return await _ollama_answer(request, state, gen, prompt, fmt, reply, body.streams, body.num_ctx)

    @api.post("/generate", responses=OLLAMA_ERRORS)
    async def ollama_generate(request: Request) -> Response:
        body = parse(OllamaGenerateRequest, await _read_json(request, state))
        name = _ollama_model(state, body.model)
        reply = OllamaReply(body.model, chat=False)
        if body.loads_only:
            return JSONResponse(reply.loaded())
        request_id = uuid.uuid4().hex
        try:
            fmt: CompletionFormat
            if body.raw or body.suffix:  # the prompt as it is, or placed by the model's fill-in-the-middle tokens
                fields = body.sampling_fields()
                num_logprobs = fields.pop("top_logprobs", 0) if fields.pop("logprobs", False) else None
                context = _context_ids(state, body.context)
                prompt_value: str | list[int] = body.prompt
                if context:
                    more = await asyncio.to_thread(_tokenize_prompts, state, body.prompt, False) if body.prompt else [[]]
                    prompt_value = context + more[0]
                completion = parse(CompletionRequest, {"model": name, "prompt": prompt_value, "suffix": body.suffix,
                                                       "request_id": request_id, **fields})
                prompts, params = await _completion_params(state, completion, completion.max_tokens, num_logprobs,
                                                           room_by_default=True)
                prompt = prompts[0]
                gen = Generation(state.engine, state.tokenizer, params, num_logprobs, "ollama", request_id=request_id)
                fmt = ChatFormat(name)
            else:
                chat = parse(ChatCompletionRequest, {**body.chat_body(request_id), "model": name})
                gen, prompt, fmt = await _chat_generation(state, chat, "ollama")
                if body.context:
                    prompt = _context_ids(state, body.context) + prompt
                    if chat.max_tokens is None:  # the room the longer prompt leaves
                        gen.params = dataclasses.replace(gen.params, max_tokens=_max_tokens(state, None, [prompt], chat=True))
                reply.context = prompt
        except APIError as exc:
            raise renamed(exc, OLLAMA_GENERATE_FIELDS) from None
        return await _ollama_answer(request, state, gen, prompt, fmt, reply, body.streams, body.num_ctx)

    @api.post("/embed", responses=OLLAMA_ERRORS)
    async def ollama_embed(request: Request) -> Response:
        body = parse(OllamaEmbedRequest, await _read_json(request, state))
        _ollama_model(state, body.model)
        started = time.perf_counter_ns()
        _check_dimensions(state, body.dimensions)
        prompts = await asyncio.to_thread(_tokenize_prompts, state, body.input, True, "input")
        limit = _embedding_limit(state, body.options)
        for i, ids in enumerate(prompts):
            if len(ids) > limit and body.truncate is False:
                where = "the input" if len(prompts) == 1 else f"input[{i}]"
                raise bad_request(f"{where} ({len(ids)} tokens) is longer than the context of {limit} tokens (truncate: "
                                  "true keeps its start)", param="input", code=CONTEXT_LENGTH_EXCEEDED)
        prompts = [ids[:limit] for ids in prompts]  # Ollama's truncation keeps the start
        params = SamplingParams.for_pooling(state.engine.default_pooling)
        vectors = await _embed(request, state, prompts, params, uuid.uuid4().hex)
        if vectors is None:
            return Response(status_code=499)
        return JSONResponse({"model": body.model, "embeddings": vectors, "total_duration": time.perf_counter_ns() - started,
                             "load_duration": 0, "prompt_eval_count": sum(len(p) for p in prompts)})

    @api.post("/embeddings", responses=OLLAMA_ERRORS)
    async def ollama_embeddings(request: Request) -> Response:
        """Ollama's older endpoint: one prompt, its vector not normalized (as Ollama gives it)."""
        body = parse(OllamaLegacyEmbedRequest, await _read_json(request, state))
        _ollama_model(state, body.model)
        prompts = await asyncio.to_thread(_tokenize_prompts, state, body.prompt, True)
        limit = _embedding_limit(state, body.options)
        pooling = dataclasses.replace(state.engine.default_pooling, normalize=False)
        vectors = await _embed(request, state, [prompts[0][:limit]], SamplingParams.for_pooling(pooling), uuid.uuid4().hex)
        if vectors is None:
            return Response(status_code=499)
        return JSONResponse({"embedding": vectors[0]})

    @api.get("/tags", responses=OLLAMA_ERRORS)
    async def ollama_tags() -> dict[str, Any]:
        facts = state.engine.model_facts
        digest = await _model_digest(state)
        return {"models": [{"name": name, "model": name, "modified_at": modified_at(facts, state.created),
                            "size": facts.size_bytes if facts else 0, "digest": digest, "details": details(facts)}
                           for name in state.model_names]}

    @api.get("/ps", responses=OLLAMA_ERRORS)
    async def ollama_running() -> dict[str, Any]:
        facts = state.engine.model_facts
        digest = await _model_digest(state)
        return {"models": [{"name": name, "model": name, "size": facts.size_bytes if facts else 0, "digest": digest,
                            "details": details(facts), "expires_at": None, "size_vram": 0,
                            "context_length": state.capacity} for name in state.model_names]}

    @api.post("/show", responses=OLLAMA_ERRORS)
    async def ollama_show(request: Request) -> dict[str, Any]:
        body = parse(OllamaShowRequest, await _read_json(request, state))
        _ollama_model(state, body.asked, "model" if body.model else "name")
        facts = state.engine.model_facts
        tokenizer = state.tokenizer
        template = getattr(tokenizer, "chat_template", None) or ""
        capabilities = ["completion"]
        if "tools" in template:
            capabilities.append("tools")
        if getattr(tokenizer, "infill", None) is not None:
            capabilities.append("insert")
        if state.engine.embedding_size:
            capabilities.append("embedding")
        return {"license": "", "modelfile": "", "parameters": ollama_parameters(state.sampling_defaults),
                "template": template, "details": details(facts), "model_info": model_info(facts, state.capacity),
                "capabilities": capabilities, "modified_at": modified_at(facts, state.created)}

    @api.get("/version")
    async def ollama_version() -> dict[str, str]:
        """The Ollama release whose API this one follows, which clients compare against the release
        a feature came with (tools, JSON schema formats), and conveyor's own."""
        return {"version": OLLAMA_API_VERSION, "conveyor_version": __version__}

    @api.post("/pull", responses=OLLAMA_ERRORS)
    async def ollama_pull(request: Request) -> Response:
        """The served model is there already; any other is not, and this server downloads nothing."""
        body = parse(OllamaPullRequest, await _read_json(request, state))
        if served_name(body.asked, state.model_names) is None:
            raise APIError(404, f"{body.asked!r} is not served here, and this server downloads no model: it serves "
                           f"{', '.join(state.model_names)}", param="model")
        if body.stream is False:
            return JSONResponse({"status": "success"})
        return Response(ndjson({"status": "success"}), media_type=NDJSON)

    app.include_router(api)

    # llama.cpp's own API (conveyor/api/llama_cpp.py), for the clients written against llama-server.
    # Not in /openapi.json, as llama-server publishes no schema of its own.
    llama = APIRouter(dependencies=[Depends(check_key)], include_in_schema=False)

    @llama.post("/completion")
    @llama.post("/completions")
    async def llama_completion(request: Request) -> Response:
        data = await _read_json(request, state)
        _check_prompt_sizes(state, data)
        return await _llama_answer(request, state, parse(LlamaCompletionRequest, data))

    @llama.post("/infill")
    async def llama_infill(request: Request) -> Response:
        return await _llama_answer(request, state, parse(LlamaInfillRequest, await _read_json(request, state)))

    @llama.post("/embedding")
    @llama.post("/embeddings")
    async def llama_embedding(request: Request) -> Response:
        """llama-server's own embeddings: each prompt pooled by the server's pooling (as /v1/embeddings),
        normalised as `embd_normalize` says, in llama-server's shape."""
        data = await _read_json(request, state)
        for name in ("content", "input"):
            _check_prompt_sizes(state, data, name, generates=False)
        body = parse(LlamaEmbeddingRequest, data)
        _check_model(state, body.model)
        _check_dimensions(state, body.dimensions)
        tokenizer = state.tokenizer
        named = await asyncio.to_thread(prompt_ids, body.prompt,
                                        lambda text, bos: tokenizer.encode(text, add_special_tokens=bos),
                                        body.prompt_field)
        prompts = _tokenize_prompts(state, named, field=body.prompt_field)  # each checked: not empty, in vocabulary
        _check_inputs_fit(state, prompts, body.prompt_field)
        pooling = dataclasses.replace(state.engine.default_pooling, normalize=False)  # embd_normalize's, below
        vectors = await _embed(request, state, prompts, SamplingParams.for_pooling(pooling), uuid.uuid4().hex,
                               body.prompt_field)
        if vectors is None:
            return Response(status_code=499)
        return JSONResponse(embedding_entries(vectors, body.embd_normalize))

    @llama.post("/apply-template")
    async def llama_apply_template(request: Request) -> dict[str, str]:
        body = parse(ApplyTemplateRequest, await _read_json(request, state))
        chat = parse(ChatCompletionRequest, {"model": state.model_names[0], "messages": body.messages})
        messages = [m.as_template_input() for m in chat.messages]
        return {"prompt": await asyncio.to_thread(_chat_text, state, messages)}

    @llama.get("/props")
    async def llama_props() -> dict[str, Any]:
        """llama-server's server properties, those its clients read (the context a request holds above all)."""
        tokenizer = state.tokenizer
        facts = state.engine.model_facts
        defaults = LlamaCompletionRequest.model_validate({}).settings(state.capacity)  # what a request not saying gets
        slots = {"total_slots": state.max_num_seqs} if state.max_num_seqs is not None else {}  # as the engine runs them
        return {"default_generation_settings": {"n_ctx": state.capacity, "params": defaults}, **slots,
                "model_alias": state.model_names[0],
                "model_path": facts.path if facts is not None else "",
                "chat_template": getattr(tokenizer, "chat_template", None) or "",
                "bos_token": tokenizer.token_to_str(tokenizer.bos_token_id) or "",
                "eos_token": tokenizer.token_to_str(tokenizer.eos_token_id) or "",
                "modalities": {"vision": False, "audio": False}, "build_info": f"conveyor {__version__}",
                "is_sleeping": False}

    app.include_router(llama)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> Response:
        """Ollama's heartbeat (its command line and some clients ask it before anything else)."""
        # Ollama's own words first: some clients look for them.
        return Response("Ollama is running (conveyor: Ollama's API under /api, OpenAI's under /v1)",
                        media_type="text/plain")

    # vLLM's tokenizer endpoints, outside /v1 as vLLM serves them (its bench client asks for them).
    tok = APIRouter(dependencies=[Depends(check_key)])

    @tok.post("/tokenize", response_model=TokenizeResponse, responses=TOKENIZER_ERRORS)
    async def tokenize(request: Request) -> Any:
        """vLLM's (`prompt` or `messages`), or llama-server's (`content`)."""
        data = await _read_json(request, state)
        if isinstance(data, dict) and "content" in data:
            asked = parse(LlamaTokenizeRequest, data)
            ids = await asyncio.to_thread(state.tokenizer.encode, asked.content, asked.add_special, asked.parse_special)
            if not asked.with_pieces:
                return JSONResponse({"tokens": ids})
            return JSONResponse({"tokens": [token_entry(t, token_bytes(state.tokenizer, t)) for t in ids]})
        chat = isinstance(data, dict) and "messages" in data
        body = parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, data)
        _check_model(state, body.model)
        if chat:
            messages = [m.as_template_input() for m in body.messages]
            ids = await asyncio.to_thread(_render_chat, state, messages, body.add_generation_prompt,
                                          body.add_special_tokens, None, body.continue_final_message,
                                          body.chat_template_kwargs)
        else:
            ids = await asyncio.to_thread(state.tokenizer.encode, body.prompt, body.add_special_tokens)
        reply: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}
        if body.return_token_strs:
            reply["token_strs"] = [state.tokenizer.token_to_str(t) for t in ids]
        return reply

    @tok.post("/detokenize", response_model=DetokenizeResponse, responses=TOKENIZER_ERRORS)
    async def detokenize(request: Request) -> dict[str, Any]:
        body = parse(DetokenizeRequest, await _read_json(request, state))
        _check_model(state, body.model)
        vocab = state.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids out of vocabulary [0, {vocab}): {bad[:5]}", param="tokens")
        # Special tokens kept (as vLLM does), so that /tokenize then /detokenize gives the text back.
        text = await asyncio.to_thread(state.tokenizer.decode, body.tokens, False)
        return {"prompt": text, "content": text}  # vLLM's clients read the first, llama-server's the second

    app.include_router(tok)

    @app.get("/version", response_model=Version)
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> Response:
        if state.draining or not state.engine.is_running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        payload, content_type = state.metrics.render()
        return Response(payload, media_type=content_type)

    install_openapi(app, {"/v1/completions": (CompletionRequest,), "/v1/chat/completions": (ChatCompletionRequest,),
                          "/v1/embeddings": (EmbeddingRequest,), "/v1/responses": (ResponsesRequest,),
                          "/v1/messages": (MessagesRequest,), "/v1/messages/count_tokens": (CountTokensRequest,),
                          "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
                          "/detokenize": (DetokenizeRequest,)}, lambda: served_limits(state))
    return app


def served_limits(state: ServerState) -> ServedLimits:
    """What this server enforces beyond the request models, for /openapi.json."""
    tokenizer = state.tokenizer
    vocab = getattr(tokenizer, "vocab_size", None)
    variables: frozenset[str] | None = None
    renders_tools: bool | None = None
    shortest_chat: int | None = None
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        try:
            variables = tokenizer.template_variables()
            probe = [{"role": "user", "content": "x"}]
            tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            renders_tools = tokenizer.apply_chat_template(probe, tools=[tool]) != tokenizer.apply_chat_template(probe)
            # The fewest tokens a chat prompt takes: one message of one character (less one, for a
            # character that is no token), answered or continued.
            rendered = [tokenizer.apply_chat_template([{"role": role, "content": "x"}], add_generation_prompt=True)
                        for role in ("user", "system")]
            rendered.append(tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}],
                                                          add_generation_prompt=False, continue_final_message=True))
            shortest_chat = min(len(tokenizer.encode_chat(text, None)) for text in rendered) - 1
        except (InvalidRequestError, ValueError):  # a template that refuses the probe: state nothing of it
            variables = renders_tools = shortest_chat = None
    infill = None if tokenizer is None else getattr(tokenizer, "infill", None) is not None
    return ServedLimits(tuple(state.model_names), state.capacity, vocab, state.max_prompt_chars,
                        state.max_num_seqs, state.priority_scheduling, variables, renders_tools, infill,
                        state.engine.embedding_size, shortest_chat)


async def _read_json(request: Request, state: ServerState) -> Any:
    return decode_json(await read_body(request, state.max_request_bytes))


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        served = ", ".join(state.model_names)
        raise APIError(404, f"the model {model!r} does not exist; this server serves: {served}",
                       param="model", code="model_not_found")


def _name(state: ServerState, model: str | None) -> str:
    return model or state.model_names[0]


def _tokenize_prompts(state: ServerState, prompt: str | list, add_special_tokens: bool = True,
                      field: str = "prompt") -> list[list[int]]:
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    out = []
    for i, p in enumerate(prompts):
        ids = state.tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else list(p)
        if not ids:
            raise bad_request(f"the {field} is empty" if len(prompts) == 1 else f"{field}[{i}] is empty", param=field)
        vocab = getattr(state.tokenizer, "vocab_size", None)  # without a tokenizer the engine checks them
        bad = [t for t in ids if vocab is not None and not 0 <= t < vocab]
        if bad:  # before anything decodes them (echo) or they reach the engine
            raise bad_request(f"token ids out of vocabulary [0, {vocab}): {bad[:5]}", param=field)
        out.append(ids)
    return out



def _log_request(state: ServerState, gen: Generation, prompts: list[list[int]]) -> None:
    cut = state.max_log_len
    for i, ids in enumerate(prompts):
        shown = ids if cut is None else ids[:cut]
        text = None if state.tokenizer is None else state.tokenizer.decode(shown, skip_special_tokens=False)[:cut]
        log.info("Received request %s-%d: prompt: %r, params: %s, prompt_token_ids: %s%s", gen.id, i, text, gen.params,
                 shown, "" if len(shown) == len(ids) else f" ... ({len(ids)} in all)")


def _infill_prompts(state: ServerState, prompt: str | list[str], suffix: str, add_special_tokens: bool,
                   keep: int | None) -> list[list[int]]:
    """Each text prompt as the prefix of a fill-in-the-middle prompt before `suffix`, cut to `keep`
    tokens (truncate_prompt_tokens) from the prefix's start and the suffix's end."""
    if state.tokenizer is None:
        raise bad_request("suffix needs the model's tokenizer, which this server does not hold", param="suffix")
    try:
        return [state.tokenizer.encode_infill(p, suffix, keep, add_special_tokens)
                for p in ([prompt] if isinstance(prompt, str) else prompt)]
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=exc.param) from exc


def _check_prompt_sizes(state: ServerState, data: Any, field: str = "prompt", generates: bool = True) -> None:
    """A 400 in constant time per prompt for one that cannot fit, on the decoded JSON, before it is
    validated, tokenized or copied: a token-id list longer than the capacity, or a text longer
    than the most characters that many tokens can hold. Measured after truncate_prompt_tokens, as
    vLLM truncates first: a text is then not bounded here (the body limit bounds it)."""
    prompt = data.get(field) if isinstance(data, dict) else None
    suffix = data.get("suffix") if isinstance(data, dict) else None
    extra = len(suffix) if isinstance(suffix, str) else 0  # a middle's prompt holds its suffix too
    keep = _truncation(state, data, generates)
    if isinstance(prompt, (str, list)):
        items = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        for item in items:
            if isinstance(item, str):
                limit, unit = (None if keep else state.max_prompt_chars), "characters"
            elif isinstance(item, list):
                limit, unit = state.capacity - (1 if generates else 0), "tokens"  # and a token to generate
            else:
                continue
            size = min(len(item), keep or len(item)) if isinstance(item, list) else len(item) + extra
            if limit is not None and size > limit:
                what = "the prompt and suffix" if extra and isinstance(item, str) else f"the {field}"
                raise bad_request(f"{what} ({size} {unit}) cannot fit the maximum model length of "
                                  f"{state.capacity} tokens", param=field, code=CONTEXT_LENGTH_EXCEEDED)


def _truncation(state: ServerState, data: Any, generates: bool = True) -> int | None:
    """The tokens a valid truncate_prompt_tokens keeps, from the undecoded body; else None."""
    keep = data.get("truncate_prompt_tokens") if isinstance(data, dict) else None
    if type(keep) is float and keep.is_integer():  # JSON's 40.0 is the integer the body takes it as
        keep = int(keep)
    if type(keep) is not int or not (keep == -1 or keep >= 1):
        return None
    return _kept(state, keep, generates)


def _check_chat_size(state: ServerState, messages: list[dict[str, str]], truncating: bool = False) -> None:
    limit = None if truncating else state.max_prompt_chars  # the rendered chat is cut to size later
    size = sum(len(m["content"]) for m in messages)
    if limit is not None and size > limit:
        raise bad_request(f"the messages ({size} characters) cannot fit the maximum model length of "
                          f"{state.capacity} tokens", param="messages", code=CONTEXT_LENGTH_EXCEEDED)


async def _grammar(state: ServerState, asked: tuple | None) -> Any:
    """The request's constraint compiled (off the engine thread), or None."""
    return None if asked is None else await compile_grammar(state.tokenizer, *asked)


def _render_chat(state: ServerState, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                 add_special_tokens: bool | None = None, tools: ToolPlan | None = None,
                 continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    text = _chat_text(state, messages, add_generation_prompt, tools, continue_final_message, template_kwargs)
    return state.tokenizer.encode_chat(text, add_special_tokens)


def _chat_text(state: ServerState, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: ToolPlan | None = None, continue_final_message: bool = False,
               template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat as the model's template writes it; a refusal names the field at fault."""
    tokenizer = state.tokenizer
    try:
        variables = dict(template_kwargs or {})
        unknown = sorted(set(variables) - tokenizer.template_variables())
        if unknown:  # a variable the template never reads would be ignored without a word
            known = ", ".join(sorted(tokenizer.template_variables())) or "none"
            raise bad_request(f"chat_template_kwargs: the chat template does not read {unknown[:5]} (it reads: "
                              f"{known})", param="chat_template_kwargs")
        chat = functools.partial(tokenizer.apply_chat_template, add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message, **variables)
        render = functools.partial(chat, messages)
        with_tools = {"tools": tools.tools} if tools else {}
        text = render(**with_tools)
        _check_fields_rendered(messages, text, lambda changed: chat(changed, **with_tools))
        if tools is not None and tools.mode == "auto" and text == render():
            raise bad_request("tool_choice 'auto' needs a chat template that renders the tools, and this model's "
                              "does not: start the server with --chat-template FILE (e.g. examples/"
                              "tool_chat_template_hermes.jinja), or send tool_choice 'required' or a named function",
                              param="tool_choice")
        if tools is not None and tools.mode == "none" and tools.tools and text == render():
            # The tools would reach the model only through the template: dropped without a word.
            raise bad_request("tools with tool_choice 'none' reach the model only through a chat template that renders "
                              "the tools, and this model's does not: leave tools out, or start the server with "
                              "--chat-template FILE", param="tools")
    except (InvalidRequestError, ValueError) as exc:  # ChatTemplateError is a ValueError too
        raise bad_request(str(exc), param=getattr(exc, "param", None) or "messages") from None
    return text


# Message fields a chat template may or may not render. tool_call_id is not among them: OpenAI
# requires it on a tool message, to link it to its call, whether or not the model sees it.
_TEMPLATE_FIELDS = ("name", "tool_calls")


def _check_fields_rendered(messages: list[dict[str, Any]], text: str, render: Any) -> None:
    """A 400 naming messages.N.FIELD for a field the chat template drops (the text is the same
    without it), as a chat_template_kwargs name it never reads. One render per role and field
    sent, not per message: a template renders a field for a role or not at all."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, message in enumerate(messages):
        for key in _TEMPLATE_FIELDS:
            if key in message:
                groups.setdefault((message["role"], key), []).append(i)
    for (role, key), where in groups.items():
        without = [{k: v for k, v in m.items() if k != key} if i in where else m for i, m in enumerate(messages)]
        if render(without) == text:
            raise bad_request(f"messages.{where[0]}.{key}: this model's chat template does not render {key} on "
                              f"{role} messages, so the model would never see it (start the server with "
                              "--chat-template FILE to use it)", param=f"messages.{where[0]}.{key}")


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's encodings of an embedding: the numbers, or their float32 bytes (little-endian) in base64."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _kept(state: ServerState, keep: int | None, generates: bool = True) -> int | None:
    """vLLM's truncate_prompt_tokens as a count of tokens (-1: as many as the model takes; a
    request that generates must still leave room to, an embedding's input may fill the context)."""
    if keep != -1:
        return keep
    return state.engine.max_model_len if generates else state.capacity


def _truncate(state: ServerState, prompts: list[list[int]], keep: int | None,
              generates: bool = True) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: keep the last `keep` tokens (-1: as many as the model takes)."""
    count = _kept(state, keep, generates)
    return prompts if count is None else [p[-count:] for p in prompts]


def _echo_texts(state: ServerState, prompt: str | list, token_ids: list[list[int]]) -> list[str]:
    """The text each prompt is echoed as: as sent when it was text, else its tokens decoded."""
    texts: list[str | None] = [prompt] if isinstance(prompt, str) else [p if isinstance(p, str) else None
                                                                          for p in prompt]
    if len(texts) != len(token_ids):  # a single prompt of token ids
        texts = [None] * len(token_ids)
    return [t if t is not None else state.tokenizer.decode(ids) for t, ids in zip(texts, token_ids)]


def _max_tokens(state: ServerState, requested: int | None, prompts: list[list[int]], chat: bool) -> int:
    """The request's max_tokens; by default 16 for completions (OpenAI), and for chat whatever room
    the prompt leaves in the context (vLLM); either at most the max_tokens the model recommends (vLLM)."""
    if requested is not None:
        return requested
    recommended = int(state.sampling_defaults.get("max_tokens", sys.maxsize))
    if not chat:
        return min(DEFAULT_COMPLETION_MAX_TOKENS, recommended)
    longest = max(len(p) for p in prompts)
    if longest >= state.capacity:
        raise bad_request(f"the prompt ({longest} tokens) leaves no room to generate within the "
                          f"maximum of {state.capacity} tokens", param="messages", code=CONTEXT_LENGTH_EXCEEDED)
    return min(state.capacity - longest, recommended)


def _chat_prompt(state: ServerState, body: ChatCompletionRequest, tools: ToolPlan | None) -> list[int]:
    """A chat request's rendered prompt, truncated as asked (`tools`: its plan_tools)."""
    messages = [m.as_template_input() for m in body.messages]
    _check_chat_size(state, messages, body.truncate_prompt_tokens is not None)
    prompt = _render_chat(state, messages, bool(body.add_generation_prompt), body.add_special_tokens, tools,
                          bool(body.continue_final_message), body.chat_template_kwargs)
    return _truncate(state, [prompt], body.truncate_prompt_tokens)[0]


async def _chat_generation(state: ServerState, body: ChatCompletionRequest,
                           prefix: str) -> tuple[Generation, list[int], CompletionFormat]:
    """A chat request's rendered prompt, its Generation (not yet handed to the engine) and the
    format its answer takes (tool calls or plain). Every refusal is an APIError (an engine's
    InvalidRequestError too), so that the Responses and Messages APIs can name their own fields."""
    _check_model(state, body.model)
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    asked = requested_grammar(body)
    if tools is not None and tools.spec is not None and asked is not None:
        raise bad_request(f"{asked[1]} cannot be combined with tool_choice {tools.mode!r}", param=asked[1])
    grammar = await _grammar(state, (tools.spec, tools.param) if tools and tools.spec else asked)
    prompt = await asyncio.to_thread(_chat_prompt, state, body, tools)
    requested = body.max_completion_tokens or body.max_tokens
    try:
        params = body.sampling_params(_max_tokens(state, requested, [prompt], chat=True), body.num_logprobs, grammar,
                                      state.sampling_defaults)
    except InvalidRequestError as exc:
        raise invalid(exc, chat=True) from None
    gen = Generation(state.engine, state.tokenizer, params, body.num_logprobs, prefix,
                     bool(body.return_tokens_as_token_ids), body.request_id)
    name = _name(state, body.model)
    if body.return_token_ids and tools is not None and tools.mode != "none":
        # The tool-call format re-frames the text as calls: no token ids line up with it.
        raise bad_request("return_token_ids cannot be combined with tool calls", param="return_token_ids")
    fmt = (ToolCallFormat(name, tools) if tools is not None and tools.mode != "none"
           else ChatFormat(name, bool(body.return_token_ids)))
    return gen, prompt, fmt


async def _completion_params(state: ServerState, body: CompletionRequest, max_tokens: int | None,
                             num_logprobs: int | None, room_by_default: bool = False) -> tuple[list[list[int]], SamplingParams]:
    """A completion request's prompts (fill-in-the-middle ones with a suffix) and sampling
    parameters; `max_tokens` None: 16 (OpenAI's), or with `room_by_default` what room the prompt
    leaves in the context."""
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    if body.suffix:
        texts = cast("str | list[str]", body.prompt)  # the request's check: a suffix comes after text
        prompts = await asyncio.to_thread(_infill_prompts, state, texts, body.suffix, add_special,
                                          _kept(state, body.truncate_prompt_tokens))
    else:
        prompts = await asyncio.to_thread(_tokenize_prompts, state, body.prompt, add_special)
        prompts = _truncate(state, prompts, body.truncate_prompt_tokens)
    grammar = await _grammar(state, requested_grammar(body))
    params = body.sampling_params(_max_tokens(state, max_tokens, prompts, chat=room_by_default), num_logprobs, grammar,
                                  state.sampling_defaults)
    if body.suffix and not params.ignore_eos:  # the middle also ends where the model pads it or starts a file
        ends = [t for t in state.tokenizer.infill.ends if t not in params.stop_token_ids]
        params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *ends])
    return prompts, params


async def _embed(request: Request, state: ServerState, prompts: list[list[int]], params: SamplingParams,
                 request_id: str, prompt_field: str = "input") -> list[list[float]] | None:
    """Each prompt's embedding (None: the client went away). In waves of a running batch's worth: a
    list of inputs longer than the waiting queue's bound (OpenAI takes 2,048) is served a wave after
    another rather than refused for good."""
    wave = state.max_num_seqs or len(prompts)
    vectors: list[list[float]] = []
    state.inflight += 1  # the whole request: a drain waits for its later waves too
    try:
        for start in range(0, len(prompts), wave):
            # A later wave's ids hold a space, which a caller's request_id cannot: no two collide.
            gen = Generation(state.engine, state.tokenizer, params, None, "embd",
                             request_id=request_id if not start else f"{request_id} +{start}")
            release = await _admit(state, gen, prompts[start: start + wave], prompt_field=prompt_field, new=not start)
            try:
                if not await run_to_end(request, gen):
                    return None
            finally:
                release()
            if any(c.embedding is None for c in gen.choices):  # aborted: the drain's grace ran out
                raise _aborted(state)
            vectors += [cast(list[float], c.embedding) for c in gen.choices]
    finally:
        state.inflight -= 1
    return vectors


NDJSON = "application/x-ndjson"


def _ollama_model(state: ServerState, asked: str, field: str = "model") -> str:
    """The served name an Ollama request's model means (a `:latest` tag taken), else a 404."""
    name = served_name(asked, state.model_names)
    if name is None:
        raise APIError(404, f"model {asked!r} not found; this server serves {', '.join(state.model_names)}",
                       param=field, code="model_not_found")
    return name


def _context_ids(state: ServerState, context: list[int] | None) -> list[int]:
    """An earlier /api/generate answer's context, checked as token ids."""
    return _tokenize_prompts(state, context, field="context")[0] if context else []


def _fit_num_ctx(state: ServerState, gen: Generation, prompt: list[int], num_ctx: int | None) -> None:
    """Ollama's num_ctx: the prompt and the output within num_ctx tokens (at most what this server
    holds)."""
    if num_ctx is None:
        return
    _check_num_ctx(state, num_ctx)
    room = num_ctx - len(prompt)
    if room < 1:
        raise bad_request(f"the prompt ({len(prompt)} tokens) leaves no room to generate within options.num_ctx "
                          f"({num_ctx})", param="options.num_ctx", code=CONTEXT_LENGTH_EXCEEDED)
    if gen.params.max_tokens is None or gen.params.max_tokens > room:
        gen.params = dataclasses.replace(gen.params, max_tokens=room)


def _check_inputs_fit(state: ServerState, prompts: list[list[int]], field: str) -> None:
    """An embedding's inputs each within the context (they generate nothing, so they may fill it),
    as the size check before tokenizing says it, naming which."""
    for i, ids in enumerate(prompts):
        if len(ids) > state.capacity:
            where = f"the {field}" if len(prompts) == 1 else f"{field}[{i}]"
            raise bad_request(f"{where} ({len(ids)} tokens) cannot fit the maximum model length of {state.capacity} "
                              "tokens", param=field, code=CONTEXT_LENGTH_EXCEEDED)


def _check_dimensions(state: ServerState, dimensions: int | None) -> None:
    width = state.engine.embedding_size
    if dimensions is not None and dimensions != width:
        raise bad_request(f"dimensions ({dimensions}): this model's embeddings have {width}, and it is not "
                          "trained to be cut shorter", param="dimensions")


def _check_num_ctx(state: ServerState, num_ctx: int) -> None:
    if num_ctx > state.capacity:
        raise bad_request(f"options.num_ctx ({num_ctx}) is more than the {state.capacity} tokens a request can hold "
                          "on this server (--max-model-len, --kv-cache-memory)", param="options.num_ctx")


def _embedding_limit(state: ServerState, options: Any) -> int:
    num_ctx = getattr(options, "num_ctx", None)
    if num_ctx is not None:
        _check_num_ctx(state, num_ctx)
    return num_ctx or state.capacity


async def _model_digest(state: ServerState) -> str:
    """The served file's sha256, as Ollama names a model's blob: read once, off the event loop, by
    the first request that asks (those asking meanwhile wait for it); "" where this process cannot
    read the file (an HF folder, or a Ray worker's)."""
    async with state.digest_lock:
        if state.model_digest is None:
            facts = state.engine.model_facts
            path = Path(facts.path) if facts is not None else None
            state.model_digest = (await asyncio.to_thread(_sha256, path)
                                  if path is not None and path.is_file() else "")
    return state.model_digest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


async def _ollama_answer(request: Request, state: ServerState, gen: Generation, prompt: list[int],
                         fmt: CompletionFormat, reply: OllamaReply, stream: bool, num_ctx: int | None) -> Response:
    """An /api/chat or /api/generate request's generation, within its num_ctx, handed to the engine
    and answered; refusals name the request's own fields."""
    def whole() -> dict[str, Any]:
        if gen.choices[0].finish_reason == "abort":
            raise _aborted(state)
        return reply.whole(gen, fmt)

    events = reply.lines(gen, fmt, lambda: _aborted(state)) if stream else None
    fields = OLLAMA_CHAT_FIELDS if reply.chat else OLLAMA_GENERATE_FIELDS
    try:
        _fit_num_ctx(state, gen, prompt, num_ctx)
        return await _answer(request, state, gen, [prompt], events, whole, chat=True,
                             prompt_field="messages" if reply.chat else "prompt", media_type=NDJSON)
    except APIError as exc:
        raise renamed(exc, fields) from None


# /v1/completions' fields as llama.cpp's API names them, for the refusals its pipeline raises.
LLAMA_FIELDS = (("^max_tokens", "n_predict"), ("^repetition_penalty", "repeat_penalty"), ("^logprobs", "n_probs"),
                ("^response_format", "json_schema"), ("^messages", "prompt"),
                ("^bad_words", "logit_bias"))  # where its `false` bans go


def _llama_prompts(state: ServerState, body: LlamaCompletionRequest) -> list[list[int]]:
    """The request's prompts as token ids: llama.cpp's prompt shapes, or /infill's framed prompt."""
    tokenizer = state.tokenizer

    def encode(text: str, bos: bool = False) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=bos)

    if not isinstance(body, LlamaInfillRequest):
        return prompt_ids(body.prompt, encode)
    fim = tokenizer.infill
    if fim is None:
        raise bad_request("this model has no fill-in-the-middle tokens: /infill needs a code model trained to infill "
                          "(e.g. Qwen2.5-Coder, StarCoder2, CodeGemma)", param="input_prefix")
    given = prompt_ids(body.prompt, lambda text, _: encode(text)) if body.prompt else [[]]
    if len(given) != 1:
        raise bad_request("/infill takes one prompt (the text the middle starts with)", param="prompt")
    frame = InfillFrame(fim.prefix, fim.suffix, fim.middle, fim.repo, fim.file_separator,
                        tokenizer.bos_token_id if tokenizer.add_bos_token else None)
    plain = lambda text: tokenizer.encode(text, add_special_tokens=False, parse_special=False)  # noqa: E731
    return [infill_prompt(body, frame, plain, given[0], state.capacity)]


async def _llama_answer(request: Request, state: ServerState, body: LlamaCompletionRequest) -> Response:
    """A /completion or /infill request served as the completion it amounts to, sampled in
    llama.cpp's order and answered in llama-server's shapes."""
    _check_model(state, body.model)
    chain = body.sampler_chain()
    tokenizer = state.tokenizer
    if "infill" in chain and (tokenizer is None or tokenizer.eos_token_id is None):
        raise bad_request("samplers: the infill sampler needs the model's end-of-generation tokens, which this model "
                          "does not name", param="samplers")
    prompts = await asyncio.to_thread(_llama_prompts, state, body)
    generates = body.n_predict != 0  # 0: the prompt computed into the cache, nothing written
    room = state.capacity - max(len(p) for p in prompts)
    if room < 1:
        where = "input_prefix" if isinstance(body, LlamaInfillRequest) else "prompt"
        raise bad_request(f"the prompt ({state.capacity - room} tokens) leaves no room to generate within the maximum of "
                          f"{state.capacity} tokens", param=where, code=CONTEXT_LENGTH_EXCEEDED)
    # llama.cpp does not bound a temperature at OpenAI's 2: the completion is checked inside /v1's
    # range, and its sampling parameters then take the request's own (up to the sampler's bound).
    fields = {**body.completion_fields(), "temperature": min(body.temperature, 2.0)}
    bias = bias_entries(body, lambda text: tokenizer.encode(text, add_special_tokens=False, parse_special=False))
    try:
        completion = parse(CompletionRequest, {"model": body.model, "prompt": prompts if len(prompts) > 1 else prompts[0],
                                               "logit_bias": bias.added or None, **fields})
        # -1: until the context is full, as llama-server (not capped by the model's recommendation)
        max_tokens = room if body.n_predict < 0 else max(body.n_predict, 1)
        prompts, params = await _completion_params(state, completion, max_tokens, body.n_probs or None)
        # llama.cpp ends a generation at any of its end-of-generation tokens: the model's ends of a
        # middle (padding, the next file) too.
        ends = [] if params.ignore_eos or tokenizer.infill is None else list(tokenizer.infill.ends)
        # ignore_eos: llama.cpp bans its end-of-generation tokens (vLLM's samples past them).
        banned = [*bias.banned, *(tokenizer.end_of_generation_ids if params.ignore_eos else ())]
        params = dataclasses.replace(params, sampler_chain=chain, temperature=body.temperature,
                                     stop_token_ids=list(dict.fromkeys([*params.stop_token_ids, *ends])),
                                     bad_words_token_ids=[*params.bad_words_token_ids,
                                                          *([t] for t in dict.fromkeys(banned))])
    except APIError as exc:
        raise renamed(exc, LLAMA_FIELDS) from None
    except InvalidRequestError as exc:
        raise renamed(invalid(exc), LLAMA_FIELDS) from None
    gen = Generation(state.engine, tokenizer, params, body.n_probs or None, "llamacpp", generates=generates)
    reply = LlamaReply(body, _name(state, body.model), state.capacity, prompts,
                       lambda ids: tokenizer.decode(ids, skip_special_tokens=False), generates)

    def whole() -> dict[str, Any] | list[dict[str, Any]]:
        if any(c.finish_reason == "abort" and c.index not in reply.stop_types for c in gen.choices):
            raise _aborted(state)
        return reply.whole(gen)

    events = reply.events(gen, lambda: _aborted(state)) if body.stream else None
    try:
        return await _answer(request, state, gen, prompts, events, whole, updates=None if body.stream else reply.run(gen))
    except APIError as exc:
        raise renamed(exc, LLAMA_FIELDS) from None


def _aborted(state: ServerState) -> APIError:
    """What a request the engine aborted before its end is answered with (not streamed)."""
    if state.draining:
        return unavailable("the server is shutting down", code="shutting_down")
    return server_error("the request was aborted inside the engine")


async def _messages_generation(state: ServerState,
                               body: MessagesRequest) -> tuple[Generation, list[int], CompletionFormat]:
    """The chat an Anthropic Messages request amounts to."""
    try:
        chat = parse(ChatCompletionRequest, body.chat_body(body.request_id or uuid.uuid4().hex))
        return await _chat_generation(state, chat, "msg")
    except APIError as exc:
        raise renamed(exc, MESSAGES_CHAT_FIELDS, body.chat_messages()[1]) from None


async def _responses_generation(state: ServerState, body: ResponsesRequest, earlier: list[Any],
                                request_id: str) -> tuple[Generation, list[int], CompletionFormat]:
    """The chat a Responses request amounts to, over the previous response's conversation and its
    input: with truncation "auto", from the earliest user turn on whose prompt leaves room for
    max_output_tokens (a binary search: the prompt only shrinks as the start moves on; a start
    whose text alone is past the context is not tried)."""
    items = earlier + body.items
    room = body.max_output_tokens or 1
    starts = [0, *turn_starts(items)] if body.truncation == "auto" else [0]
    if len(starts) > 1 and state.max_prompt_chars is not None:
        chars_from = [0] * (len(items) + 1)  # the text from each item on (as _check_chat_size counts it)
        for i in range(len(items) - 1, -1, -1):
            chars_from[i] = chars_from[i + 1] + len(items[i].text)
        starts = [s for s in starts if chars_from[s] <= state.max_prompt_chars] or starts[-1:]

    async def attempt(start: int) -> tuple[tuple[Generation, list[int], CompletionFormat] | None, APIError | None]:
        try:
            chat = parse(ChatCompletionRequest, body.chat_body(items[start:], request_id))
            gen, prompt, fmt = await _chat_generation(state, chat, "resp")
        except APIError as exc:
            error = renamed(exc, RESPONSES_CHAT_FIELDS, body.message_fields(items, len(earlier), start))
            if exc.code != CONTEXT_LENGTH_EXCEEDED:
                raise error from None
            return None, error
        if len(prompt) + room <= state.capacity:
            return (gen, prompt, fmt), None
        blamed = "max_output_tokens" if body.max_output_tokens and len(prompt) < state.capacity else "input"
        auto = body.truncation == "auto"
        what = "the input from its last user turn on" if auto and start else "the input"
        hint = " (truncation 'auto' drops the oldest turns)" if blamed == "input" and not auto else ""
        return None, bad_request(f"{what} ({len(prompt)} tokens) plus max_output_tokens ({room}) cannot fit the "
                                 f"maximum model length of {state.capacity} tokens{hint}", param=blamed,
                                 code=CONTEXT_LENGTH_EXCEEDED)

    low, high = 0, len(starts) - 1
    found, refusal = None, None
    while low <= high:
        middle = (low + high) // 2
        fits, error = await attempt(starts[middle])
        if fits is not None:
            found, high = fits, middle - 1
        else:
            refusal, low = error, middle + 1
    if found is None:
        assert refusal is not None
        raise refusal
    return found


async def _admit(state: ServerState, gen: Generation, prompts: list[list[int]], echo: list[str] | None = None,
                 chat: bool = False, prompt_field: str = "prompt", new: bool = True) -> Callable[[], None]:
    """Hand the prompts to the engine (or answer why not); what to call once the answer is out.
    `new` False: more prompts of a request already admitted, served while the server drains until
    its grace is over."""
    if (new and state.draining) or state.aborting:
        state.metrics.rejected("shutting_down").inc()
        raise unavailable("the server is shutting down", code="shutting_down")
    state.inflight += 1  # from here: a drain waits for a request still being handed to the engine
    try:
        if state.log_requests and log.isEnabledFor(logging.INFO):
            await asyncio.to_thread(_log_request, state, gen, prompts)  # decoding a long prompt takes a while
        await gen.submit(prompts, echo)
    except BaseException as exc:
        state.inflight -= 1
        if isinstance(exc, QueueFullError):
            state.metrics.rejected("queue_full").inc()
            raise unavailable(str(exc)) from None
        if isinstance(exc, EngineStoppedError):
            raise unavailable(str(exc), code="shutting_down") from None
        if isinstance(exc, InvalidRequestError):
            state.metrics.rejected("invalid").inc()
            raise invalid(exc, chat, prompt_field) from None
        raise
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            state.inflight -= 1
            gen.close()

    return release


async def _serve(request: Request, state: ServerState, gen: Generation, prompts: list[list[int]],
                 fmt: CompletionFormat, stream: bool, include_usage: bool, echo: list[str] | None = None) -> Response:
    events = stream_events(gen, fmt, include_usage) if stream else None
    return await _answer(request, state, gen, prompts, events, lambda: whole_body(gen, fmt), echo,
                         chat=isinstance(fmt, ChatFormat))


async def _answer(request: Request, state: ServerState, gen: Generation, prompts: list[list[int]],
                  events: AsyncIterator[str] | None, whole: Callable[[], Any],
                  echo: list[str] | None = None, chat: bool = False, prompt_field: str = "prompt",
                  media_type: str = "text/event-stream", updates: AsyncIterator[Any] | None = None) -> Response:
    """Hand the prompts to the engine, then answer with `events` streamed (SSE, or `media_type`), or
    with `whole()` once every choice has ended (the generation's updates read through `updates`
    where given); 499 (and the requests aborted) if the client goes away first."""
    release = await _admit(state, gen, prompts, echo, chat, prompt_field)
    if events is not None:
        return SSEResponse(events, release, media_type)
    try:
        finished = await run_to_end(request, gen, updates)
    finally:
        release()
    return JSONResponse(whole()) if finished else Response(status_code=499)
