"""Structured outputs: grammars compiled with llguidance (grammar.py) and the engine's per-request
matchers (matchers.py). The request-side spec and the step's masks are plain data in
conveyor.sampling.structured; the runner applies the masks (conveyor.sampling.masking)."""
from conveyor.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarError, compiler_for

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError", "compiler_for"]
