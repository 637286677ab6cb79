"""The simulator's runner and clock: the real LLMEngine steps on virtual time.

`SimRunner.execute` computes no tensors: it asks a cost model how long the step would take,
advances the virtual clock by that much and returns one token per sampling request. The engine
stamps each token with the clock, so per-request timestamps (and every metric built on them)
are those of the simulated hardware. `VirtualClock.sleep` is what the offline driver calls when
the engine is idle until the next arrival: it jumps straight there, which makes the driver a
discrete-event loop.
"""
from __future__ import annotations

import random
from typing import Protocol, Sequence

from conveyor.bench.workloads import FIRST_REGULAR_ID
from conveyor.kv import SlidingWindow
from conveyor.runner.stats import StepStats
from conveyor.sampling.outputs import SamplerOutput
from conveyor.scheduler import SchedulerOutput
from conveyor.request import Request
from conveyor.sim.shape import StepShape


class CostModel(Protocol):
    name: str

    def step_time(self, shape: StepShape) -> float: ...

    def describe(self) -> str: ...


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go backwards ({seconds} s)")
        self.now += seconds

    sleep = advance


class SimRunner:
    # A regular token id that no workload treats as a stop: workloads set ignore_eos anyway, and the
    # simulated engine is built with no EOS ids, so requests end at max_tokens as on the real one.
    TOKEN = FIRST_REGULAR_ID
    supports_speculation = True  # speculative tokens are accepted at random (spec_acceptance)

    def __init__(self, cost_model: CostModel, clock: VirtualClock, spec_acceptance: float = 0.0,
                 seed: int = 0, attention_window: int | None = None, kv_window: SlidingWindow | None = None) -> None:
        """spec_acceptance: the chance that each speculative token is accepted, given that the
        ones before it were (the workload's; measured ones are in docs/BENCHMARKS.md).
        attention_window: the model's sliding window, where its window layers' attention stops;
        kv_window: those layers' own KV pool, which the engine's KV manager then keeps (as the real
        runner's kv_window)."""
        self.cost_model = cost_model
        self.attention_window = attention_window
        self.kv_window = kv_window
        self.clock = clock
        self.spec_acceptance = spec_acceptance
        self._random = random.Random(seed)
        self.num_steps = 0
        self.busy_s = 0.0

    def execute(self, out: SchedulerOutput, stats: StepStats) -> SamplerOutput:
        shape = StepShape.of(out, self.attention_window)
        seconds = self.cost_model.step_time(shape)
        self.clock.advance(seconds)
        self.num_steps += 1
        self.busy_s += seconds
        stats.model_s = seconds
        requests = out.sampling_requests()
        if not any(r.spec_token_ids for r in requests):
            return SamplerOutput([self.TOKEN] * len(requests))
        accepted = []
        for request in requests:
            count = 0
            while count < len(request.spec_token_ids) and self._random.random() < self.spec_acceptance:
                count += 1
            accepted.append(count)
        return SamplerOutput([self.TOKEN] * len(requests), num_accepted=accepted)


class SimProposer:
    """Proposes `depth` placeholder tokens whenever asked: in the simulator, whether they are right
    is the runner's draw (SimRunner.spec_acceptance), not the tokens'."""

    cost_per_token = 0.0

    def propose(self, requests: Sequence[Request], depths: Sequence[int]) -> list[list[int]]:
        return [[SimRunner.TOKEN] * depth for depth in depths]
