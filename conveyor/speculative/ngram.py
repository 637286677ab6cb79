"""Prompt lookup (vLLM's `ngram` method): the tokens that followed the latest earlier occurrence of
the sequence's longest recent suffix. An edited file, a quoted passage or a repeated structure is
then proposed from where it already appeared, for no model work at all."""
from __future__ import annotations

import weakref
from typing import Sequence

from conveyor.request import Request


class _Index:
    """Per request: for each suffix length n, n-gram -> the position after its latest occurrence.
    Tokens only ever append to a sequence (rejected proposals never enter it), so the index grows
    by the new tokens' n-grams at each lookup instead of being rebuilt."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed_until = 0  # n-grams ending before this position are in the tables


class NgramProposer:
    cost_per_token = 0.0  # seconds of work a proposed token costs besides its row: none to speak of

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: weakref.WeakKeyDictionary[Request, _Index] = weakref.WeakKeyDictionary()

    def propose(self, requests: Sequence[Request], depths: Sequence[int]) -> list[list[int]]:
        return [self.propose_one(request, depth) for request, depth in zip(requests, depths)]

    def propose_one(self, request: Request, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens to follow the request's verified tokens; [] when no suffix of
        prompt_lookup_min or more tokens occurred before."""
        if max_tokens <= 0:
            return []
        tokens = request.prompt_token_ids + request.output_token_ids
        index = self._indexes.get(request)
        if index is None:
            index = self._indexes[request] = _Index(self.min_n, self.max_n)
        end = len(tokens)
        # Index every n-gram that ends before the current suffix's end: the suffix must not find itself.
        for n, table in index.tables.items():
            for stop in range(max(n, index.indexed_until), end):
                table[tuple(tokens[stop - n : stop])] = stop
        index.indexed_until = end
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            found = index.tables[n].get(tuple(tokens[end - n :]))
            if found is not None:
                return tokens[found : found + max_tokens]
        return []
