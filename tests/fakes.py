"""A runner that computes nothing: it returns deterministic tokens, so the engine, scheduler and
KV manager can be driven at speed without a model."""
from __future__ import annotations

import itertools
from typing import Callable

from conveyor.config import EngineConfig, SchedulerConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.runner.stats import StepStats
from conveyor.sampling.outputs import SamplerOutput
from conveyor.scheduler import SchedulerOutput


class FakeRunner:
    def __init__(self, vocab_size: int = 1000) -> None:
        self.vocab_size = vocab_size
        self.block_size = EngineConfig().block_size  # the engine's: fake_engine sets it
        self.steps: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput, stats: StepStats) -> SamplerOutput:
        self.steps.append(out)
        tokens = []
        for request in out.sampling_requests():
            table = out.block_tables[request.request_id]
            assert len(table) * self.block_size >= request.num_tokens, "no slot for a scheduled token"
            # A pure function of the sequence so far: the same request gives the same tokens
            # whatever it is batched with and however often it is preempted.
            tokens.append((sum(request.prompt_token_ids) * 31 + request.num_tokens * 7) % self.vocab_size)
        return SamplerOutput(tokens)


class FailingRunner(FakeRunner):
    """A FakeRunner whose step raises whenever a request with a poisoned prompt (its first token
    in `poison`) is in the batch: a stand-in for a request that breaks the shared step."""

    def __init__(self, poison: set[int], vocab_size: int = 1000) -> None:
        super().__init__(vocab_size)
        self.poison = poison
        self.calls = 0

    def execute(self, out: SchedulerOutput, stats: StepStats) -> SamplerOutput:
        self.calls += 1
        if any(r.prompt_token_ids[0] in self.poison for r, _ in out.scheduled):
            raise RuntimeError("poisoned batch")
        return super().execute(out, stats)


def fake_engine(
    runner: FakeRunner | None = None,
    policy: str = "continuous",
    *,
    block_size: int = 4,
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    budget: int = 64,
    chunked: bool = True,
    max_model_len: int = 256,
    clock: Callable[[], float] | None = None,
    prefix_caching: bool = True,
    scheduling_policy: str = "fcfs",
) -> LLMEngine:
    """An engine on a fake runner (FakeRunner by default) with a strictly increasing, deterministic
    clock (one tick per reading) unless `clock` is given: the scheduler tests' engine."""
    config = EngineConfig(block_size=block_size, enable_prefix_caching=prefix_caching, scheduler=SchedulerConfig(
        policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, chunked_prefill=chunked,
        scheduling_policy=scheduling_policy))
    runner = runner if runner is not None else FakeRunner()
    runner.block_size = block_size
    if clock is None:
        ticks = itertools.count()
        clock = lambda: float(next(ticks))  # noqa: E731
    return LLMEngine(config, runner, num_kv_blocks=num_blocks, max_model_len=max_model_len,
                     vocab_size=runner.vocab_size, clock=clock)
