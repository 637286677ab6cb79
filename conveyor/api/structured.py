"""The request fields that constrain an output, read into one GrammarSpec, compiled before the
request reaches the engine.

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
{"name", "description", "schema", "strict"}}; llama.cpp's {"type": "json_object", "schema": S}
constrains to S), vLLM's `structured_outputs` ({"json" | "regex" | "choice" |
"grammar" | "json_object": ...}) and vLLM's older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. At most one may be given; a schema, regex or grammar that does not compile is a
400 naming the field it came from, and so is a key none of these defines. The output is always
constrained, as vLLM does; `strict: true` also closes every object to the properties it lists
(OpenAI's strict mode) unless the schema sets `additionalProperties` itself.
"""
from __future__ import annotations

import asyncio
from typing import Any

from conveyor.api.errors import APIError, bad_request
from conveyor.errors import InvalidRequestError
from conveyor.structured.spec import GrammarSpec
from conveyor.structured.grammar import GrammarError, compiler_for

# vLLM's StructuredOutputsParams keys that this server does not implement: refused, not ignored.
_UNSUPPORTED_STRUCTURED_KEYS = ("structural_tag", "whitespace_pattern", "disable_any_whitespace",
                                "disable_fallback", "disable_additional_properties")
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _spec(kind: str, value: Any, param: str) -> GrammarSpec:
    try:
        if kind == "json":
            return GrammarSpec.json_schema(value)
        if kind == "regex":
            return GrammarSpec.regex(value)
        if kind == "choice":
            return GrammarSpec.choice(value)
        if kind == "grammar":
            return GrammarSpec.grammar(value)
    except InvalidRequestError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None
    raise bad_request(f"{param}: unknown kind {kind!r}", param=param)


def refuse_unknown_keys(obj: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    """A 400 naming `where.key` for a key nothing reads: it would be ignored without a word (a
    typo, another server's option)."""
    unknown = [key for key in obj if key not in known]
    if unknown:
        raise bad_request(f"{where}.{unknown[0]} is not a known field (known: {', '.join(known)})",
                          param=f"{where}.{unknown[0]}")


def _from_response_format(fmt: dict[str, Any]) -> tuple[GrammarSpec, str] | None:
    """(spec, the field it came from), or None for type "text". llama.cpp's server's
    {"type": "json_object", "schema": S} is honoured as S."""
    kind = fmt.get("type")
    if kind is None:
        raise bad_request("response_format.type is required: 'text', 'json_object' or 'json_schema'",
                          param="response_format.type")
    if kind == "text":
        refuse_unknown_keys(fmt, ("type",), "response_format")
        return None
    if kind == "json_object":
        refuse_unknown_keys(fmt, ("type", "schema"), "response_format")
        if fmt.get("schema") is None:
            return GrammarSpec.json_object(), "response_format"
        return _spec("json", fmt["schema"], "response_format.schema"), "response_format.schema"
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          param="response_format.type")
    refuse_unknown_keys(fmt, ("type", "json_schema"), "response_format")
    body = fmt.get("json_schema")
    if not isinstance(body, dict):
        raise bad_request("response_format.json_schema is required for type 'json_schema'",
                          param="response_format.json_schema")
    refuse_unknown_keys(body, ("name", "description", "schema", "strict"), "response_format.json_schema")
    if "schema" not in body:
        raise bad_request("response_format.json_schema.schema is required", param="response_format.json_schema.schema")
    if not isinstance(body.get("strict", False), (bool, type(None))):
        raise bad_request("response_format.json_schema.strict must be a boolean",
                          param="response_format.json_schema.strict")
    param = "response_format.json_schema.schema"
    try:
        return GrammarSpec.json_schema(body["schema"], strict=bool(body.get("strict"))), param
    except InvalidRequestError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None


def _from_structured_outputs(so: dict[str, Any]) -> tuple[GrammarSpec, str] | None:
    refuse_unknown_keys(so, _STRUCTURED_KINDS + _UNSUPPORTED_STRUCTURED_KEYS, "structured_outputs")
    for key in _UNSUPPORTED_STRUCTURED_KEYS:
        if so.get(key) not in (None, False, ""):
            raise bad_request(f"structured_outputs.{key} is not supported by this server",
                              param=f"structured_outputs.{key}")
    given = [k for k in _STRUCTURED_KINDS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise bad_request(f"structured_outputs takes one of {', '.join(_STRUCTURED_KINDS)}; got {', '.join(given)}",
                          param="structured_outputs")
    if not given:
        return None
    kind, param = given[0], f"structured_outputs.{given[0]}"
    if kind == "json_object":
        return GrammarSpec.json_object(), param
    return _spec(kind, so[kind], param), param


def requested_grammar(body: Any) -> tuple[GrammarSpec, str] | None:
    """(spec, the field it came from) of a completions or chat request body, or None."""
    found: list[tuple[GrammarSpec, str]] = []
    if body.response_format is not None:
        got = _from_response_format(body.response_format)
        if got is not None:
            found.append(got)
    if body.structured_outputs:
        got = _from_structured_outputs(body.structured_outputs)
        if got is not None:
            found.append(got)
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            found.append((_spec(kind, value, f"guided_{kind}"), f"guided_{kind}"))
    if len(found) > 1:
        raise bad_request(f"give one structured-output constraint, not {len(found)}: "
                          f"{', '.join(param for _, param in found)}", param=found[1][1])
    return found[0] if found else None


async def compile_grammar(tokenizer: Any, spec: GrammarSpec, param: str) -> GrammarSpec:
    """Compile on a worker thread (never the engine's, never the event loop); the compiled grammar
    rides in `spec.compiled`. Raises a 400 naming `param` when it does not compile."""
    if tokenizer is None:
        raise APIError(400, "structured outputs need a tokenizer", param=param)
    try:
        await asyncio.to_thread(compiler_for(tokenizer).compile, spec)
    except GrammarError as exc:
        raise bad_request(f"{param}: {exc}", param=param, code="invalid_grammar") from None
    return spec
