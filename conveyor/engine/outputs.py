"""What the engine hands back each step: per-request progress, and per-step statistics."""
from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.errors import ConveyorError
from conveyor.request import RequestTimes


@dataclass
class SamplerOutput:
    """What a runner returns for one step: a token per sampling request, in order."""

    tokens: list[int]
    # Per sampling request: {token id: logprob} for the chosen token and the top alternatives,
    # or None where the request did not ask for logprobs (the list is None if nobody did).
    logprobs: list[dict[int, float] | None] | None = None


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
    text: str | None = None  # the decoded output, set once finished
    times: RequestTimes | None = None
    num_preemptions: int = 0
    index: int = 0  # which of the request's n samples this is
    logprobs: list[dict[int, float]] | None = None  # per token of new_token_ids, when asked for
    # Set on the last output of a request the engine failed (finish_reason "error"): a step raised
    # because of it (conveyor.errors.RequestFailedError); the others in the batch went on.
    error: ConveyorError | None = None


@dataclass
class StepStats:
    """Where one step's time went; `model` is the forward pass, the rest is engine overhead."""

    num_requests: int = 0
    num_tokens: int = 0
    num_preempted: int = 0
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    model_s: float = 0.0
    sample_s: float = 0.0
    postprocess_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.model_s + self.sample_s + self.postprocess_s
