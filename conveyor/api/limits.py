"""Bounds on what a request may make the server do before any real work: the body is read up to a
byte limit (413 past it, never buffered whole), its JSON nesting is bounded before it is decoded,
and a prompt that cannot fit the model is refused in time that does not grow with its length."""
from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi import Request

from conveyor.api.errors import APIError, bad_request

MAX_JSON_DEPTH = 32  # the API's deepest legal body (chat content parts) nests 5 levels

# A JSON string or one bracket: regex scanning stays in C, so the depth check costs ~nothing.
_JSON_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_KEY_AFTER = re.compile(rb"\s*:")


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds the server's limit of {limit} bytes "
                         "(conveyor serve --max-request-bytes)", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed `limit`: from Content-Length before
    reading anything, else while streaming it (what was read so far is all that is held)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("the Content-Length header is not a number", code="invalid_header")
        if int(declared) > limit:
            raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(raw: bytes) -> Any:
    """The decoded body, or a 400: malformed JSON, invalid UTF-8, an integer longer than Python
    converts (4,300 digits), or nesting too deep to decode (the decoder hits Python's recursion
    limit) with the field it is under as `param`."""
    try:
        return json.loads(raw, parse_constant=_not_json, parse_float=_finite)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError and the digit limit are all ValueErrors
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        pass
    nesting_error(raw)
    raise bad_request("the JSON nests too deeply", code="too_deeply_nested")


def strict_json(text: str) -> Any:
    """What a JSON text inside a request holds, read as the body is (no NaN or Infinity, no float
    past its range); ValueError for anything else, nesting too deep included."""
    try:
        return json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except RecursionError:
        raise ValueError("the JSON nests too deeply") from None


def _not_json(constant: str) -> float:
    raise ValueError(f"{constant} is not a JSON number (Python's decoder reads it; JSON has no such value)")


def _finite(number: str) -> float:
    value = float(number)
    if math.isinf(value):
        raise ValueError(f"the number {number[:40]} is beyond a 64-bit float's range")
    return value


def nesting_error(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise the 400 naming the top-level field whose value nests deeper than `max_depth`. A regex
    scan over strings and brackets, run only for a body the decoder refused: it stops at the
    first point past the bound."""
    depth, field = 0, None
    for match in _JSON_TOKENS.finditer(raw):
        token = match.group()
        if token[0] == 0x22:  # a string: remember it if it is a key of the top-level object
            if depth == 1 and _KEY_AFTER.match(raw, match.end()):
                field = token[1:-1].decode("utf-8", "replace")
        elif token in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                where = f"{field}: " if field else ""
                raise bad_request(f"{where}the JSON nests deeper than {max_depth} levels", param=field,
                                  code="too_deeply_nested")
        else:
            depth -= 1


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The longest vocabulary entry in characters (doubled, for normalisers that merge characters),
    so a text of more than capacity * this many characters cannot fit; None if unknown."""
    backend = getattr(tokenizer, "backend", None)
    get_vocab = getattr(backend, "get_vocab", None)
    if get_vocab is None:
        return None
    return 2 * max((len(token) for token in get_vocab(with_added_tokens=True)), default=1)
