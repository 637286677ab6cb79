"""The engine's grammar state: one llguidance matcher per constrained request.

The step is vLLM's: schedule -> (forks copy their parent's matcher) -> token masks of the
constrained sampling rows -> forward -> the runner applies the masks to those rows and samples ->
each matcher advances by its accepted token -> a request whose grammar is complete stops.

A matcher belongs to a request, not to its KV: preemption (recompute) keeps it, since the tokens
it accepted stay accepted; a request taken over from another engine (P/D handover) gets a fresh
matcher that replays the output tokens it already has. Requests are held weakly, so a finished or
aborted request's matcher goes with it. With no constrained request in flight a step pays one
empty-dict check.
"""
from __future__ import annotations

import logging
import weakref
from typing import Sequence

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from conveyor.errors import InvalidRequestError
from conveyor.request import Request
from conveyor.structured.spec import TokenMasks
from conveyor.structured.grammar import GrammarCompiler, GrammarTokenizer, compiler_for

log = logging.getLogger("conveyor.structured")


class GrammarMatchers:
    def __init__(self, tokenizer: GrammarTokenizer | None, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.compiler: GrammarCompiler | None = compiler_for(tokenizer, vocab_size) if tokenizer else None
        self._matchers: weakref.WeakKeyDictionary[Request, llguidance.LLMatcher] = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return len(self._matchers)

    def constrains(self, request: Request) -> bool:
        return request in self._matchers

    def start(self, request: Request) -> None:
        """Give a constrained request its matcher, advanced past the output it already has.
        Raises InvalidRequestError (leaving nothing behind) if the grammar cannot be had."""
        spec = request.sampling_params.structured
        if spec is None:
            return
        if self.compiler is None:
            raise InvalidRequestError("structured outputs need an engine with a tokenizer")
        matcher = self.compiler.compile(spec).new_matcher()
        if request.output_token_ids and not matcher.consume_tokens(request.output_token_ids):
            raise InvalidRequestError(f"the request's output does not match its grammar: {matcher.get_error()}")
        self._matchers[request] = matcher

    def fork(self, parent: Request, child: Request) -> None:
        matcher = self._matchers.get(parent)
        if matcher is not None:
            self._matchers[child] = matcher.deep_copy()

    def masks(self, requests: Sequence[Request]) -> TokenMasks | None:
        """The allowed tokens of every constrained row of this step; None if there is none."""
        if not self._matchers:
            return None
        rows = [(i, m) for i, r in enumerate(requests) if (m := self._matchers.get(r)) is not None]
        if not rows:
            return None
        bitmask = np.full((len(rows), self.words), -1, dtype=np.int32)
        # One after another on this thread: a JSON mask takes microseconds, and llguidance's thread
        # pool (LLExecutor) only adds hand-offs that wait for a core on a busy 2-core machine.
        for j, (_, matcher) in enumerate(rows):
            fill_next_token_bitmask(matcher, bitmask, j)
        return TokenMasks([i for i, _ in rows], bitmask)

    def accept(self, request: Request, token: int) -> bool:
        """Advance the request's matcher by its sampled token; True when the grammar is complete
        (nothing but EOS may follow) or the matcher failed, so the request must stop."""
        matcher = self._matchers.get(request)
        if matcher is None:
            return False
        if not matcher.consume_token(token):
            log.warning("request %s: token %d rejected by its grammar: %s", request.request_id, token,
                        matcher.get_error())
            return True
        return matcher.is_stopped()

    def forget(self, request: Request) -> None:
        self._matchers.pop(request, None)
