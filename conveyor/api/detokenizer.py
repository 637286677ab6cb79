"""Incremental detokenisation for streaming, correct for multi-byte characters and stop strings.

Decoding token by token breaks a character whose UTF-8 bytes span tokens (the first token decodes
to U+FFFD), so text is taken from the difference between decoding a short window with and without
the new tokens, and only once it no longer ends in U+FFFD (the scheme of vLLM and TGI). Streamed
text is never retracted, so nothing at or past a stop string is released, and a tail that could be
the start of a stop string is held back until the next token settles it. The engine's final text
(cut at the stop string) is the authority for the last chunk.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Protocol, Sequence

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.text = ""  # everything decoded so far (may run past a stop string)
        self.emitted = 0  # characters of `text` already released
        self._prefix = 0  # window start: a few tokens of context for the decoder
        self._read = 0  # tokens whose text is already in `text`

    def add(self, token_ids: Sequence[int]) -> None:
        self.token_ids.extend(token_ids)
        window = self.token_ids[self._prefix :]
        before = self.tokenizer.decode(self.token_ids[self._prefix : self._read])
        after = self.tokenizer.decode(window)
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.token_ids)

    def _safe_end(self) -> int:
        """How much of `text` can be released without ever having to take it back."""
        end = len(self.text)
        if not self.stop:
            return end
        start = max(0, self.emitted - max(map(len, self.stop)))
        for stop in self.stop:
            at = self.text.find(stop, start)
            if at >= 0:
                end = min(end, at)
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

    def finish(self, final_text: str | None) -> str:
        """The rest of the text once the engine says the sample is done."""
        if final_text is None:  # e.g. aborted: release what cannot be part of a stop string
            end = len(self.text)
            for stop in self.stop:
                at = self.text.find(stop)
                end = min(end, at) if at >= 0 else end
            final_text = self.text[: max(end, self.emitted)]
        delta = final_text[self.emitted :]
        self.emitted = len(final_text)
        return delta


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    from conveyor.model.tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer: object, token_id: int) -> bytes:
    """The raw bytes one token stands for (byte-level BPE), for logprob entries."""
    spelled = getattr(tokenizer, "token_to_str", lambda _: None)(token_id)
    table = _byte_decoder()
    if spelled and all(c in table for c in spelled):
        return bytes(table[c] for c in spelled)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()  # type: ignore[attr-defined]


def token_text(tokenizer: object, token_id: int) -> str:
    """One token as text; a fragment of a multi-byte character is shown as `bytes:\\xNN` (OpenAI)."""
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
