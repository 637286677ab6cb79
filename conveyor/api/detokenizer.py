"""One token's bytes and text, for logprob entries. Output text is made (and stop strings found)
by conveyor.engine.detokenizer, shared with LLM.generate."""
from __future__ import annotations

from conveyor.model.tokenizer import token_bytes


def token_text(tokenizer: object, token_id: int) -> str:
    """One token as text; a fragment of a multi-byte character is shown as `bytes:\\xNN` (OpenAI)."""
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
