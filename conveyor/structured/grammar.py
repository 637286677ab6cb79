"""Grammars for structured outputs, compiled with llguidance and cached by their canonical text.

Why llguidance rather than xgrammar: its wheel is ~3 MB of Rust with no Python dependencies, while
xgrammar pulls transformers and triton (and wants torch at run time), which this CPU-only project,
whose serving process imports no torch, refuses. llguidance computes a mask in well under a
millisecond for JSON schemas (an Earley parser over a lazily built token trie), compiles a schema in
milliseconds (both measured with SmolLM2-135M's tokenizer: docs/BENCHMARKS.md, "Structured
outputs"), and is what vLLM's `guidance` backend and llama.cpp use.

llguidance's tokenizer description is built from conveyor's own tokenizer (the bytes each token
id stands for, the special ids, the end-of-turn/EOS ids), never from a Hugging Face download. A
compiled grammar is a pristine `LLMatcher`; each request gets a deep copy (microseconds).
Compilation happens off the engine thread (the API layer calls `compile` on a worker thread) and
is kept in an LRU keyed by the spec's canonical text, so a repeated schema costs nothing.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from conveyor.errors import InvalidRequestError
from conveyor.structured.spec import GrammarSpec

CACHE_SIZE = 256
# Compact JSON with no free whitespace: a small model given a choice of whitespace can spend its
# whole budget on newlines; "," and ":" are what json.dumps(separators=(",", ":")) writes.
JSON_OPTIONS: "JsonCompileOptions" = {"whitespace_flexible": False}


class GrammarError(InvalidRequestError):
    """A schema, regex, choice list or grammar that does not compile."""


class GrammarTokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_to_str(self, token_id: int | None) -> str | None: ...


@dataclass
class CompiledGrammar:
    spec_key: str
    vocab_size: int
    template: llguidance.LLMatcher  # never advanced: requests take deep copies
    compile_s: float

    def new_matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


def token_byte_table(tokenizer: GrammarTokenizer, vocab_size: int) -> tuple[list[bytes], list[int]]:
    """(bytes of every token id, special token ids): byte-level BPE spelling undone, special tokens
    as their text (llguidance marks them special and never matches them as text)."""
    from conveyor.model.tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    backend = getattr(tokenizer, "backend", None)
    special = set()
    if backend is not None:
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    tokens: list[bytes] = []
    for token_id in range(vocab_size):
        spelled = tokenizer.token_to_str(token_id) if token_id < tokenizer.vocab_size else None
        if spelled is None:
            tokens.append(b"")  # padding rows of the embedding: never allowed
        elif token_id in special or not all(c in byte_of for c in spelled):
            tokens.append(spelled.encode() if token_id in special else
                          tokenizer.decode([token_id], skip_special_tokens=False).encode())
        else:
            tokens.append(bytes(byte_of[c] for c in spelled))
    return tokens, sorted(special)


class _Wrapped:
    """What llguidance.TokenizerWrapper reads."""

    def __init__(self, tokenizer: GrammarTokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.tokens, self.special_token_ids = token_byte_table(tokenizer, vocab_size)
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for the spec (not yet checked)."""
    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        # \d means [0-9], as in JSON Schema patterns, not any Unicode digit (Rust's default).
        return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(spec.source, 'd')}/")
    if spec.kind in ("choice", "grammar"):
        try:  # choice: a JSON list of strings; grammar: llama.cpp GBNF, or Lark
            return llguidance.grammar_from(spec.kind if spec.kind == "choice" else "ebnf", spec.source)
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


class GrammarCompiler:
    """Thread-safe: the API's worker threads and (for requests that arrive uncompiled, e.g. from
    the offline LLM class or a Ray worker) the engine share one per tokenizer."""

    def __init__(self, tokenizer: GrammarTokenizer, vocab_size: int | None = None,
                 cache_size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self.hits = self.misses = 0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                wrapped = llguidance.TokenizerWrapper(_Wrapped(self.tokenizer, self.vocab_size))
                self._ll_tokenizer = llguidance.LLTokenizer(
                    wrapped, n_vocab=self.vocab_size, eos_token=list(self.tokenizer.eos_token_ids))
            return self._ll_tokenizer

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The spec's grammar (from the cache when seen before); also stored in `spec.compiled`.
        Raises GrammarError with llguidance's message when it does not compile."""
        compiled = spec.compiled
        if compiled is not None and compiled.spec_key == spec.key and compiled.vocab_size == self.vocab_size:
            return compiled
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
        if hit is None:
            hit = self._compile(spec)
            with self._lock:
                self.misses += 1
                self._cache[spec.key] = hit
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        spec.compiled = hit
        return hit

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            text = grammar_text(spec)
        except ValueError as exc:  # e.g. a schema that is not a JSON object
            raise GrammarError(str(exc)) from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return CompiledGrammar(spec.key, self.vocab_size, matcher, time.perf_counter() - start)


def _first_line(message: str) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines()[:3])


_compilers: "weakref.WeakKeyDictionary[Any, GrammarCompiler]" = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: GrammarTokenizer, vocab_size: int | None = None) -> GrammarCompiler:
    """The one compiler (and cache) of this tokenizer, shared by the API and the engine."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None or (vocab_size and compiler.vocab_size != vocab_size):
            compiler = GrammarCompiler(tokenizer, vocab_size)
            _compilers[tokenizer] = compiler
        return compiler
