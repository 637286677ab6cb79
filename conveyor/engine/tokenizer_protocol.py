"""What the engine needs of a tokenizer: conveyor.model.tokenizer.Tokenizer is one, tests bring others."""
from __future__ import annotations

from typing import Protocol, Sequence


class TextCodec(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    bos_token_id: int | None  # the grammar compiler (conveyor/structured) reads the last two

    def token_to_str(self, token_id: int | None) -> str | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
