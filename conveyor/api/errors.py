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

    # Of a union's alternatives, the one that failed on the value, not on its type, says most; else
    # the one that got furthest into the value (input.0.content, not input's text alternative).
    value_errors = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    first = value_errors[0] if value_errors else max(errors, key=lambda e: len(path(e)))
    loc = path(first)
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
    return part in ("str", "int", "float", "bool", "list[str]", "list[int]", "list[list[int]]") or "[" in part


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        chat = request.url.path.endswith("/chat/completions")
        return invalid(exc, chat).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = APIError(exc.status_code, str(exc.detail), code=code, headers=getattr(exc, "headers", None))
        return err.response()

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
