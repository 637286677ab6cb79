"""A runner that computes nothing: it returns deterministic tokens, so the engine, scheduler and
KV manager can be driven at speed without a model."""
from __future__ import annotations

from conveyor.kv.manager import KVCacheManager
from conveyor.runner.stats import StepStats
from conveyor.sampling.outputs import SamplerOutput
from conveyor.scheduler import SchedulerOutput


class FakeRunner:
    def __init__(self, vocab_size: int = 1000) -> None:
        self.vocab_size = vocab_size
        self.steps: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput, kv: KVCacheManager, stats: StepStats) -> SamplerOutput:
        self.steps.append(out)
        tokens = []
        for request in out.sampling_requests():
            table = kv.block_tables[request.request_id]
            assert len(table) * kv.block_size >= request.num_tokens, "no slot for a scheduled token"
            # A pure function of the sequence so far: the same request gives the same tokens
            # whatever it is batched with and however often it is preempted.
            tokens.append((sum(request.prompt_token_ids) * 31 + request.num_tokens * 7) % self.vocab_size)
        return SamplerOutput(tokens)
