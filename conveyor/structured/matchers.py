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
        """The allowed tokens of every constrained row of this step; None if there is none. Each
        request has 1 + len(spec_token_ids) rows, in order: the mask of the row after a
        speculative token is the grammar's state once that token is taken (a proposal is cut where
        its grammar stops allowing it, cut_proposal, so every one of them can be taken)."""
        if not self._matchers:
            return None
        rows: list[int] = []
        row = 0
        constrained = []
        for request in requests:
            matcher = self._matchers.get(request)
            if matcher is not None:
                constrained.append((row, request, matcher))
            row += 1 + len(request.spec_token_ids)
        if not constrained:
            return None
        bitmask = np.full((sum(1 + len(r.spec_token_ids) for _, r, _ in constrained), self.words), -1,
                          dtype=np.int32)
        # One after another on this thread: a JSON mask takes microseconds, and llguidance's thread
        # pool (LLExecutor) only adds hand-offs that wait for a core on a busy 2-core machine.
        j = 0
        for first_row, request, matcher in constrained:
            drafts = request.spec_token_ids
            for k in range(len(drafts) + 1):
                fill_next_token_bitmask(matcher, bitmask, j)
                rows.append(first_row + k)
                j += 1
                if k < len(drafts):
                    matcher.consume_token(drafts[k])
            if drafts:
                matcher.rollback(len(drafts))
        return TokenMasks(rows, bitmask)

    def cut_proposal(self, request: Request) -> None:
        """Drop the request's speculative tokens from the first one its grammar forbids."""
        matcher = self._matchers.get(request)
        if matcher is not None and request.spec_token_ids:
            del request.spec_token_ids[matcher.validate_tokens(request.spec_token_ids):]

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
