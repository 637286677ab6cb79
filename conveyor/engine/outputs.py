"""What the engine hands back each step: per-request progress."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from conveyor.errors import ConveyorError
from conveyor.request import RequestTimes
from conveyor.sampling.outputs import TokenLogprobs


class Logprob(float):
    """A token's logprob as vLLM's offline API gives it (`.logprob`, `.rank`, `.decoded_token`) that
    is also the plain float conveyor's API gave, so code written for either reads it. `rank`: 1 for
    the likeliest token; the top alternatives asked for are ranked by their order, the chosen token
    by its place in the whole distribution (as vLLM ranks them)."""

    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> "Logprob":
        value = super().__new__(cls, logprob)
        value.rank, value.decoded_token = rank, decoded_token
        return value

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    __str__ = float.__repr__  # print(), f-strings and csv write the number, as they did for a float


def ranked_logprobs(step: dict[int, float], chosen: int, top: int, decode: Callable[[int], str]) -> dict[int, Logprob]:
    """One token's logprobs ({token id: logprob}: the `chosen` token's and the `top` likeliest) as
    vLLM's Logprob objects. The `top` likeliest are ranked 1..top; the chosen token has its rank
    among them, or where it is not one of them (the step then holds top + 1 entries; with top 0,
    always) its place in the whole distribution, which the sampler counted (TokenLogprobs.rank)."""
    alternatives = [t for t in step if t != chosen] if len(step) > top else list(step)
    ranks: dict[int, int | None] = {token: i + 1 for i, token in
                                     enumerate(sorted(alternatives, key=lambda t: -step[t])[:top])}
    ranks.setdefault(chosen, step.rank if isinstance(step, TokenLogprobs) else None)
    return {token: Logprob(lp, ranks.get(token), decode(token)) for token, lp in step.items()}


@dataclass
class CompletionOutput:
    """One sample of a prompt as LLM.generate ends it (vLLM's shape: `RequestOutput.outputs[i]`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of its tokens' logprobs, with logprobs asked for
    logprobs: list[dict[int, Logprob]] | None  # per token: the chosen one's and the top alternatives'
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    new_token_ids: list[int]  # the ones this step added
    finished: bool
    finish_reason: str | None = None  # "stop", "length" or "abort", as OpenAI/vLLM name them
    stop_reason: int | str | None = None  # the stop token id or string that ended it, if any
    text: str | None = None  # the output text, set by LLM.generate once finished (the engine makes none)
    times: RequestTimes | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    index: int = 0  # which of the request's n samples this is
    # Per token of new_token_ids, when asked for (on the output LLM.generate returns: every token's,
    # as Logprob objects).
    logprobs: list[dict[int, float]] | None = None
    # With prompt_logprobs: one entry per prompt token (None for the first), on the first output.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # An embedding request's vector (SamplingParams.pooling), on its final output.
    embedding: list[float] | None = None
    # Set on the last output of a request the engine ended with an error (finish_reason "error"): a
    # step raised because of it (RequestFailedError), or its constraints left no token to sample
    # (NoAllowedTokenError); the others in the batch went on.
    error: ConveyorError | None = None

    # The last of new_token_ids is the EOS or stop_token_ids entry that ended it: a token of the
    # output, whose text is left out of it unless include_stop_str_in_output (vLLM).
    ended_on_stop_token: bool = False
    # Set by LLM.generate on the output it returns for a prompt: all n of its samples (this
    # output's own fields are sample 0's). The engine's step outputs leave it empty.
    outputs: list[CompletionOutput] = field(default_factory=list)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding as LLM.embed returns it (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    prompt: str | None = None
    finished: bool = True
