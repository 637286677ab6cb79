"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.errors import InvalidRequestError
from conveyor.sampling.params import SamplingParams

log = logging.getLogger("conveyor.api")

RETRY_AFTER_S = "1"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str = "server_overloaded") -> APIError:
    headers = {"Retry-After": RETRY_AFTER_S}
    return APIError(503, message, type="service_unavailable_error", code=code, headers=headers)


# SamplingParams' messages start with the field at fault; its fields carry the request's names.
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {"structured"} | {"prompt"}


def invalid(exc: InvalidRequestError, chat: bool = False, prompt_field: str = "prompt") -> APIError:
    """The 400 for an engine refusal, `param` set: the field the engine named, else the field the
    message starts with (SamplingParams' messages do). A chat's prompt is its messages; another
    endpoint's is `prompt_field` (embeddings': input)."""
    message = str(exc)
    param = getattr(exc, "param", None)
    if param is None:
        first = message.split(" ", 1)[0]
        param = first if first in _SAMPLING_FIELDS else None
    if param == "bad_words_token_ids":
        param = "bad_words"
    if param == "prompt":
        param = "messages" if chat else prompt_field
    elif chat and param == "logprobs":
        param = "top_logprobs"
    return bad_request(message, param=param, code=exc.code)


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def from_validation(exc: ValidationError | RequestValidationError) -> APIError:
    """The first problem pydantic found, with its field path as `param`."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    def path(error: Any) -> list[str]:
        # Union members show up in the path (e.g. stop.str): keep only the field names the client sent.
        return [str(p) for p in error.get("loc", ()) if p != "body" and not _is_type_tag(str(p))]

    def wrong_type(error: Any) -> bool:
        # A literal compared with something that is not a string (an object where a mode's name
        # would go) is as much a wrong type as a string where an object should be.
        kind = str(error.get("type", ""))
        return kind.endswith("_type") or (kind == "literal_error" and not isinstance(error.get("input"), str))

    # Of a union's alternatives, the one that failed on the value, not on its type, says most; else
    # the one that got furthest into the value (input.0.content, not input's text alternative);
    # alternatives that got as far along different paths are named by the path they share.
    value_errors = [e for e in errors if not wrong_type(e)]
    if value_errors:
        first, loc = value_errors[0], path(value_errors[0])
    else:
        def alternative(error: Any) -> tuple[str, ...]:
            return tuple(str(p) for p in error.get("loc", ()) if _is_type_tag(str(p)))

        depth = max(len(path(e)) for e in errors)
        deepest = [e for e in errors if len(path(e)) == depth]
        first, loc = deepest[0], path(deepest[0])
        for other in deepest[1:]:
            if alternative(other) == alternative(first):
                continue  # two faults of one alternative (two bad items): the first is named
            shared = 0
            while shared < len(loc) and loc[shared] == path(other)[shared]:
                shared += 1
            loc = loc[:shared]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = f"{param} is required"
    elif first.get("type") == "extra_forbidden":  # OpenAI's wording for a parameter it does not know
        message = f"Unrecognized request argument supplied: {param}"
    elif param:
        message = f"{param}: {message}"
    return bad_request(message, param=param, code=first.get("type"))


def _is_type_tag(part: str) -> bool:
    """A union member's tag in an error's path: a type (str, list[int], function-after[...]) or a
    model's class name (the API's own field names are all snake_case)."""
    return (part in ("str", "int", "float", "bool", "list[str]", "list[int]", "list[list[int]]") or "[" in part
            or (part[:1].isupper() and part.isidentifier()))


ANTHROPIC_PATH = "/v1/messages"  # Anthropic's Messages API: its errors take Anthropic's envelope
OLLAMA_PATH = "/api/"  # Ollama's API: its errors are {"error": "<message>"}
# Anthropic's error types for our statuses (its 529 "overloaded" is our 503).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    405: "invalid_request_error", 413: "request_too_large", 503: "overloaded_error"}


def anthropic_error_type(error: APIError) -> str:
    return _ANTHROPIC_TYPES.get(error.status, "api_error")


def respond(request: Request, error: APIError) -> JSONResponse:
    """The error as the endpoint's API spells it: OpenAI's `{"error": {...}}`; on Anthropic's
    Messages API `{"type": "error", "error": {"type", "message", ...}}`, a full queue as its 529
    (overloaded), which its clients retry; on Ollama's, `{"error": "<message>"}`."""
    if request.url.path.startswith(OLLAMA_PATH):  # a message alone: it names the field where it does not
        named = error.param is None or error.param in error.message
        message = error.message if named else f"{error.param}: {error.message}"
        return JSONResponse({"error": message}, status_code=error.status, headers=error.headers)
    if not request.url.path.startswith(ANTHROPIC_PATH):
        return error.response()
    body = error.body()
    body["error"]["type"] = anthropic_error_type(error)
    status = 529 if error.code == "server_overloaded" else error.status
    return JSONResponse({"type": "error", **body}, status_code=status, headers=error.headers)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        chat = request.url.path.endswith("/chat/completions")
        return respond(request, invalid(exc, chat))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, from_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = APIError(exc.status_code, str(exc.detail), code=code, headers=getattr(exc, "headers", None))
        return respond(request, err)

    # Not `exception_handler(Exception)`: Starlette answers those from ServerErrorMiddleware, which
    # then re-raises to the server, and the server closes the keep-alive connection.
    app.add_middleware(CatchUnexpected)


INTERNAL_ERROR = "internal server error; the details are in the server log"


class CatchUnexpected:
    """Answers an exception no handler took with a generic 500 (the details go to the log only)
    and returns normally, so the connection stays usable for the client's next request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:  # else the response is under way: all that can be done is to end it
                await server_error(INTERNAL_ERROR).response()(scope, receive, send)
