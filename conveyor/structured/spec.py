"""What a constrained request asks for, and the token masks one step applies (pure Python).

A `GrammarSpec` is plain data (it pickles, so it crosses to Ray workers); the grammar compiled
from it (conveyor.structured.grammar) rides along in `compiled` so that the engine thread never
compiles, and is dropped when pickled (the receiving engine compiles again from its own cache).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from conveyor.errors import InvalidRequestError

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]
GRAMMAR_KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(eq=False)
class GrammarSpec:
    """`source` is canonical: a JSON schema or a choice list as compact JSON text (key order kept:
    properties are generated in the order the schema lists them), a regex
    or an EBNF/Lark grammar as given. Two specs with the same `key` compile to the same grammar."""

    kind: GrammarKind
    source: str
    compiled: Any = field(default=None, repr=False)  # conveyor.structured.grammar.CompiledGrammar

    @property
    def key(self) -> str:
        return f"{self.kind}\x00{self.source}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GrammarSpec) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __getstate__(self) -> dict[str, Any]:
        return {"kind": self.kind, "source": self.source, "compiled": None}

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | bool, strict: bool = False) -> "GrammarSpec":
        """strict (OpenAI's): an object admits only the properties its schema lists, unless the
        schema says otherwise with `additionalProperties`; plain JSON Schema admits any others."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("a JSON schema must be a JSON object")
        if strict:
            schema = closed_objects(schema)
        return cls("json", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequestError("a regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> "GrammarSpec":
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(choices, separators=(",", ":")))

    @classmethod
    def grammar(cls, text: str) -> "GrammarSpec":
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequestError("a grammar must be a non-empty string")
        return cls("grammar", text)


@dataclass
class TokenMasks:
    """One step's allowed tokens: `bitmask[j]` (int32 words, bit t % 32 of word t // 32 set when
    token t is allowed) belongs to sampling row `rows[j]` (one per sampling request, or 1 + its
    speculative tokens); rows not listed are unconstrained."""

    rows: list[int]
    bitmask: Any  # numpy int32 [len(rows), ceil(vocab / 32)]


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that lists properties
    and says nothing about others."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples") else closed_objects(v)) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out
