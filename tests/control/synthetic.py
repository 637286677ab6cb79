"""Synthetic step-time traces for the controller: a linear cost on a virtual clock, the controller's
hooks driven with stand-in scheduler state, and an engine on a timed FakeRunner."""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from conveyor.config import EngineConfig
from conveyor.control import SloController
from conveyor.control.step_model import StepFeatures, step_features
from conveyor.engine.llm_engine import LLMEngine
from conveyor.request import Request, RequestStatus
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler import SchedulerOutput
from conveyor.sim.runner import VirtualClock
from tests.fakes import FakeRunner


@dataclass
class LinearCost:
    """step = a + b x decode rows + c x prefill tokens + d x rows x longest context (seconds)."""

    a: float = 0.070
    b: float = 0.0025
    c: float = 0.0006
    d: float = 2e-6
    scale: float = 1.0  # a machine that slows down: multiply everything

    def __call__(self, f: StepFeatures) -> float:
        return self.scale * (self.a + self.b * f.decode_rows + self.c * f.prefill_tokens
                             + self.d * f.decode_rows * f.decode_context)


class TimedRunner(FakeRunner):
    """FakeRunner whose steps cost `cost(features)` x (1 + |noise|) on the virtual clock."""

    def __init__(self, clock: VirtualClock, cost: LinearCost, noise: float = 0.0, seed: int = 0) -> None:
        super().__init__(vocab_size=1000)
        self.clock, self.cost, self.noise, self.rng = clock, cost, noise, random.Random(seed)

    def execute(self, out, stats):  # noqa: ANN001, ANN201 - the Runner protocol
        self.clock.now += self.cost(step_features(out)) * (1 + self.noise * abs(self.rng.gauss(0, 1)))
        self.steps.clear()  # keep memory flat over long runs
        return super().execute(out, stats)


def make_engine(clock: VirtualClock, cost: LinearCost, noise: float = 0.0, num_kv_blocks: int = 4096,
                **kwargs: object) -> LLMEngine:
    config = EngineConfig.from_kwargs(**{"max_num_seqs": 64, "max_num_batched_tokens": 2048, **kwargs})
    return LLMEngine(config, TimedRunner(clock, cost, noise), num_kv_blocks=num_kv_blocks, max_model_len=4096,
                     vocab_size=1000, clock=clock)


@dataclass
class StubScheduler:
    """What the controller reads of a scheduler, and the limits it sets."""

    waiting: deque = field(default_factory=deque)
    num_running: int = 0
    requests: dict = field(default_factory=dict)
    limits: tuple = (None, None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def set_limits(self, seqs: int | None, tokens: int | None) -> None:
        self.limits = (seqs, tokens)


def decode_step(rows: int, context: int, prefill: int = 0) -> SchedulerOutput:
    """A step of `rows` decode rows at `context` tokens, plus one prefill chunk of `prefill` tokens."""
    out = SchedulerOutput()
    params = SamplingParams(max_tokens=4096, ignore_eos=True)
    for i in range(rows):  # each decoding its output's last token (a prompt's own tokens are a chunk)
        r = Request(f"d{i}", [11] * (context - 1), params, 0.0, status=RequestStatus.RUNNING, output_token_ids=[11])
        r.num_computed_tokens = context - 1
        out.scheduled.append((r, 1))
    if prefill:
        out.scheduled.append((Request("p", [11] * prefill, params, 0.0), prefill))
    return out


def drive(controller: SloController, cost: LinearCost, steps: int, context: int = 256,
          prefill_per_row: float = 0.5, waiting: int = 10) -> list[int]:
    """Steps a saturated engine: the batch is always at the controller's cap (someone is waiting).
    Returns the cap after each step."""
    scheduler = StubScheduler(waiting=deque([Request("w", [11], SamplingParams(), 0.0)] * waiting))
    caps = []
    for _ in range(steps):
        controller.before_schedule(scheduler, 0.0)
        rows = controller.cap
        out = decode_step(rows, context, int(rows * prefill_per_row))
        scheduler.num_running = rows
        controller.on_scheduled(out, scheduler)
        controller.after_step(cost(step_features(out)), [], [], scheduler)
        caps.append(controller.cap)
    return caps
