"""What sampling returns for one step (pure Python: the simulator's runner builds it too)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplerOutput:
    """What a runner returns for one step: a token per sampling request, in order."""

    tokens: list[int]
    # Per sampling request: {token id: logprob} for the chosen token and the top alternatives,
    # or None where the request did not ask for logprobs (the list is None if nobody did).
    logprobs: list[dict[int, float] | None] | None = None
    # request id -> {token id: logprob} for each prompt token this step scored, in order.
    prompt_logprobs: dict[str, list[dict[int, float]]] | None = None
