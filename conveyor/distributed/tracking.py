"""The front end's record of one request in flight on a Ray deployment."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from conveyor.distributed.messages import TokenEvent
from conveyor.distributed.router import WorkerHandle
from conveyor.engine.outputs import RequestOutput
from conveyor.request import RequestTimes
from conveyor.sampling.params import SamplingParams


@dataclass(eq=False)
class TrackedRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: asyncio.Queue
    arrival: float
    role: str  # where it is submitted: replica, prefill (then handed over) or decode (whole)
    worker: WorkerHandle | None = None
    attempts: int = 0
    expected_cached_tokens: int = 0  # what the router expects the worker's prefix cache to hold
    num_cached_tokens: int = 0  # what it did hold (the worker says so with the first token)
    streamed: bool = False
    busy: bool = False  # being submitted or handed over: that task, not a death handler, owns it
    aborted: bool = False
    unfinished: int = 1  # samples not finished yet
    tokens: dict[int, list[int]] = field(default_factory=dict)  # per sample, as streamed
    times: dict[int, RequestTimes] = field(default_factory=dict)  # front-end clock: workers' clocks differ

    def outstanding_tokens(self) -> int:
        """Its share of its worker's load (see conveyor.distributed.router)."""
        if self.streamed or self.role == "decode":
            return self.unfinished
        return len(self.prompt) - self.expected_cached_tokens

    def deliver(self, event: TokenEvent) -> RequestOutput:
        """Fold a worker's slim event into the RequestOutput the API layer reads, and pass it on."""
        now = time.perf_counter()
        tokens = self.tokens.setdefault(event.index, [])
        tokens.extend(event.new_token_ids)
        first_event = event.index not in self.times  # with its first token, or an embedding's only event
        times = self.times.setdefault(event.index, RequestTimes(arrival=self.arrival))
        times.tokens.extend(now for _ in event.new_token_ids)
        if first_event and event.index == 0:
            self.num_cached_tokens = event.num_cached_tokens
        if times.first_token is None and event.new_token_ids:
            times.first_token = now
        if event.finished:
            times.finished = now
            self.unfinished -= 1
        self.streamed = True
        out = RequestOutput(
            request_id=self.request_id, prompt=None, prompt_token_ids=self.prompt, token_ids=list(tokens),
            new_token_ids=list(event.new_token_ids), finished=event.finished, finish_reason=event.finish_reason,
            stop_reason=event.stop_reason, text=event.text, times=times, num_preemptions=event.num_preemptions,
            index=event.index, logprobs=event.logprobs, num_cached_tokens=self.num_cached_tokens,
            ended_on_stop_token=event.ended_on_stop_token, prompt_logprobs=event.prompt_logprobs,
            embedding=event.embedding,
        )
        self.sink.put_nowait(out)
        return out
