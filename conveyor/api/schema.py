"""The API's schema as /openapi.json serves it: the response shapes (so client generators and
fuzzers can check answers) and the request bodies, which the handlers read themselves (to bound
their size before decoding) and so must be declared by hand."""
from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


_ERRORS = {"model": ErrorResponse}
V1_ERRORS: dict[int | str, dict[str, Any]] = {401: {**_ERRORS, "description": "missing or wrong API key"}}
GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    **V1_ERRORS,
    400: {**_ERRORS, "description": "invalid request; `param` names the field"},
    404: {**_ERRORS, "description": "unknown model"},
    413: {**_ERRORS, "description": "body larger than --max-request-bytes"},
    500: {**_ERRORS, "description": "engine fault (generic message; details in the server log)"},
    503: {**_ERRORS, "description": "waiting queue full or shutting down (Retry-After)"},
}


TOKENIZER_ERRORS: dict[int | str, dict[str, Any]] = {
    key: GENERATION_ERRORS[key] for key in (401, 400, 404, 413)
}


def generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    # With "stream": true: Server-Sent Events whose data are chunk objects, then "[DONE]". No schema
    # is declared for them: OpenAPI 3.1 has no way to describe the events one by one.
    stream: dict[str, Any] = {"text/event-stream": {}}
    return {200: {"model": model, "content": stream}, **GENERATION_ERRORS}


def install_openapi(app: FastAPI, request_bodies: dict[str, tuple[type[BaseModel], ...]]) -> None:
    """Serve the generated schema with the request body models of the POST routes put in (a route
    that takes one of several bodies, as /tokenize does, gets their anyOf)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, models in request_bodies.items():
                refs = []
                for model in models:
                    body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                    components.update(body.pop("$defs", {}))
                    components[model.__name__] = body
                    refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}},
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
