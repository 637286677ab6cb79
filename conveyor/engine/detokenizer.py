"""Incremental detokenisation, correct for multi-byte characters, and the one place stop strings
are searched for (the engine thread sees token ids only).

Decoding token by token breaks a character whose UTF-8 bytes span tokens (the first token decodes
to U+FFFD), so text is taken from the difference between decoding a short window with and without
the new tokens, and only once it no longer ends in U+FFFD (the scheme of vLLM and TGI). Text only
ever grows, so each new piece is searched for the stop strings once, together with the few
characters before it that a stop string could start in. Streamed text is never retracted: nothing
at or past a stop string is released, and a tail that could be the start of a stop string is held
back until the next token settles it. Used by the server (conveyor.api.generation) and by
LLM.generate, which end the request as soon as `stopped` turns true.
"""
from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        """`min_tokens`: stop strings are not looked for until that many tokens are in (vLLM)."""
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything decoded so far (may run past a stop string by a token's text)
        self.emitted = 0  # characters of `text` already released
        self.stop_reason: str | None = None  # the stop string found, once found
        self.num_tokens_at_stop = 0  # tokens added when it was found: the ones that count
        self._end: int | None = None  # the output's end in `text` once stopped
        self._prefix = 0  # window start: a few tokens of context for the decoder
        self._read = 0  # tokens whose text is already in `text`
        self._textless = 0  # trailing tokens whose text is left out: the stop token that ended it
        self._longest = max(map(len, self.stop), default=0)

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int], ends_on_stop_token: bool = False) -> None:
        """Decode the new tokens; ignored once a stop string was found (the output ended there).
        `ends_on_stop_token`: the last one is the EOS or stop_token_ids entry that ended the output;
        it counts as a token, but its text is left out unless include_stop_str_in_output (vLLM)."""
        if self.stopped:
            return
        self.token_ids.extend(token_ids)
        self._textless = int(ends_on_stop_token and not self.include_stop_str_in_output)
        end = len(self.token_ids) - self._textless
        before = self._decode(self.token_ids[self._prefix : self._read])
        after = self._decode(self.token_ids[self._prefix : end])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._append(after[len(before) :])
            self._prefix, self._read = self._read, end

    def _append(self, piece: str) -> None:
        start = max(0, len(self.text) - self._longest + 1)  # a stop string may begin before the piece
        self.text += piece
        if len(self.token_ids) < self.min_tokens:
            return
        found = [(at, s) for s in self.stop if (at := self.text.find(s, start)) >= 0]
        if found:
            at, stop = min(found)
            self.stop_reason, self.num_tokens_at_stop = stop, len(self.token_ids)
            self._end = at + len(stop) if self.include_stop_str_in_output else at

    def _safe_end(self) -> int:
        """How much of `text` can be released without ever having to take it back."""
        if self._end is not None:
            return max(self._end, self.emitted)
        end = len(self.text)
        for stop in self.stop:  # a tail that a later token could complete into a stop string
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    end = min(end, len(self.text) - k)
                    break
        return max(end, self.emitted)

    def release(self) -> str:
        """Text that is now safe to stream."""
        end = self._safe_end()
        delta, self.emitted = self.text[self.emitted : end], end
        return delta

    def finish(self) -> str:
        """The rest of the text once the output has ended (its last tokens decoded as they are,
        an incomplete character as U+FFFD, as a whole decode shows it)."""
        end = len(self.token_ids) - self._textless
        if not self.stopped and self._read < end:
            before = self._decode(self.token_ids[self._prefix : self._read])
            self._append(self._decode(self.token_ids[self._prefix : end])[len(before) :])
            self._read = end
        end = self._end if self._end is not None else len(self.text)
        delta, self.emitted = self.text[self.emitted : max(end, self.emitted)], max(end, self.emitted)
        return delta

    @property
    def output_text(self) -> str:
        """The whole output text as released so far (all of it after finish)."""
        return self.text[: self.emitted]
