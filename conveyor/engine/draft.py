"""Proposals from a draft model: a smaller model of the same vocabulary, run by a second engine.

The draft engine is an LLMEngine like any other (its own scheduler, KV blocks and runner), on the
engine thread beside the target's. To propose, each request's verified tokens go to it as a greedy
request for `depth` tokens, batched with the other requests' in the draft's own steps; its prefix
cache keeps what the last proposal computed, so the next one recomputes only what changed (the
partly filled last block, and the tokens verified since). A rejected proposal needs no rollback:
its tokens never enter the next prompt, so their blocks' keys are never matched again.
"""
from __future__ import annotations

import time
from typing import Protocol, Sequence

from conveyor.engine.outputs import RequestOutput
from conveyor.request import Request
from conveyor.sampling.params import SamplingParams


class DraftEngine(Protocol):
    vocab_size: int
    max_model_len: int

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    @property
    def has_unfinished_requests(self) -> bool: ...


class DraftModelProposer:
    # How much each new measurement of the draft's cost counts (an exponential average).
    COST_WEIGHT = 0.2

    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self.cost_per_token = 0.0  # seconds of draft steps per proposed token, measured

    def propose(self, requests: Sequence[Request], depths: Sequence[int]) -> list[list[int]]:
        started = time.perf_counter()
        for request, depth in zip(requests, depths):
            self.engine.add_request(request.prompt_token_ids + request.output_token_ids,
                                    SamplingParams(max_tokens=depth, temperature=0.0, ignore_eos=True),
                                    request_id=request.request_id)
        proposals: dict[str, list[int]] = {}
        while self.engine.has_unfinished_requests:
            for output in self.engine.step():
                if output.finished:
                    proposals[output.request_id] = list(output.token_ids)
        proposed = sum(len(tokens) for tokens in proposals.values())
        if proposed:
            cost = (time.perf_counter() - started) / proposed
            self.cost_per_token += self.COST_WEIGHT * (cost - self.cost_per_token)
        return [proposals.get(request.request_id, []) for request in requests]
