"""The simulator's runner and clock: the real LLMEngine steps on virtual time.

`SimRunner.execute` computes no tensors: it asks a cost model how long the step would take,
advances the virtual clock by that much and returns one token per sampling request. The engine
stamps each token with the clock, so per-request timestamps (and every metric built on them)
are those of the simulated hardware. `VirtualClock.sleep` is what the offline driver calls when
the engine is idle until the next arrival: it jumps straight there, which makes the driver a
discrete-event loop.
"""
from __future__ import annotations

from typing import Protocol

from conveyor.bench.workloads import FIRST_REGULAR_ID
from conveyor.runner.stats import StepStats
from conveyor.sampling.outputs import SamplerOutput
from conveyor.scheduler import SchedulerOutput
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

    def __init__(self, cost_model: CostModel, clock: VirtualClock) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.num_steps = 0
        self.busy_s = 0.0

    def execute(self, out: SchedulerOutput, stats: StepStats) -> SamplerOutput:
        shape = StepShape.of(out)
        seconds = self.cost_model.step_time(shape)
        self.clock.advance(seconds)
        self.num_steps += 1
        self.busy_s += seconds
        stats.model_s = seconds
        return SamplerOutput([self.TOKEN] * shape.sampled)
