"""What the engine hands back each step: per-request progress."""
from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.errors import ConveyorError
from conveyor.request import RequestTimes


@dataclass
class CompletionOutput:
    """One sample of a prompt as LLM.generate ends it (vLLM's shape: `RequestOutput.outputs[i]`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of its tokens' logprobs, with logprobs asked for
    logprobs: list[dict[int, float]] | None  # per token: the chosen one's and the top alternatives'
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
    # Per token of new_token_ids, when asked for (on the output LLM.generate returns: every token's).
    logprobs: list[dict[int, float]] | None = None
    # With prompt_logprobs: one entry per prompt token (None for the first), on the first output.
    prompt_logprobs: list[dict[int, float] | None] | None = None
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
