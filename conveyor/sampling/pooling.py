"""Embeddings: a request that computes its prompt and returns one vector made from its final hidden
states, instead of sampling tokens (pure Python: the scheduler reads which positions it pools).

A decoder model's embedding is pooled from the final-normed hidden states of the prompt's tokens,
as vLLM's pooling runner and llama.cpp's `--embeddings` make it: the last token's ("last", vLLM's
default for a decoder model, and what Qwen3-Embedding and e5-mistral are trained for), the mean
over every token ("mean"), or the first token's ("cls"); then scaled to unit length unless
`normalize` is off. The same request runs through the scheduler as any other: chunked, preempted
and recomputed, or started from cached prefix blocks where no pooled position is skipped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.errors import InvalidRequestError

POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    pooling_type: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                                      f"{self.pooling_type!r}", param="pooling_type")
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be a boolean, got {self.normalize!r}", param="normalize")

    def __str__(self) -> str:
        what = {"last": "the last token's final hidden state", "mean": "the mean of the final hidden states",
                "cls": "the first token's final hidden state"}[self.pooling_type]
        return what + (", normalized" if self.normalize else "")

    def positions(self, num_prompt_tokens: int) -> range:
        """The prompt positions whose hidden states make the embedding."""
        if self.pooling_type == "mean":
            return range(num_prompt_tokens)
        if self.pooling_type == "cls":
            return range(min(1, num_prompt_tokens))
        return range(num_prompt_tokens - 1, num_prompt_tokens)

    def embedding(self, total: list[float], count: int) -> list[float]:
        """The embedding from the sum of the pooled positions' hidden states and their count."""
        vector = [v / count for v in total] if count > 1 else list(total)
        return normalized(vector, EUCLIDEAN) if self.normalize else vector


# llama.cpp's codes for a normalisation (its `embd_normalize`, `--embd-normalize`); a p above 2 is
# the p-norm.
NO_NORM, MAX_ABSOLUTE, TAXICAB, EUCLIDEAN = -1, 0, 1, 2
_INT16_RANGE = 32760.0  # llama.cpp's: the largest value of a MAX_ABSOLUTE vector


def normalized(vector: list[float], norm: int) -> list[float]:
    """`vector` divided by its norm `norm` (llama.cpp's codes above; the Euclidean one is vLLM's
    and OpenAI's unit length), a zero vector left as it is. MAX_ABSOLUTE scales the largest
    magnitude to llama.cpp's int16 range."""
    if norm < NO_NORM:
        raise InvalidRequestError(f"a normalisation is -1 (none), 0 (max absolute), 1 (taxicab), 2 (Euclidean) or a p "
                                  f"above 2 (p-norm), got {norm}", param="norm")
    if norm == NO_NORM:
        return list(vector)
    largest = max((abs(v) for v in vector), default=0.0)
    if norm == MAX_ABSOLUTE:
        size = largest / _INT16_RANGE
    elif norm == EUCLIDEAN:
        size = math.sqrt(math.fsum(v * v for v in vector))
    elif largest > 0.0:  # in units of the largest magnitude, so that no power overflows
        size = largest * math.fsum((abs(v) / largest) ** norm for v in vector) ** (1.0 / norm)
    else:
        size = 0.0
    return [v / size for v in vector] if size > 0.0 else list(vector)
