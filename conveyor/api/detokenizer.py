"""One token's bytes and text, for logprob entries. Output text is made (and stop strings found)
by conveyor.engine.detokenizer, shared with LLM.generate."""
from __future__ import annotations

from functools import lru_cache


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
