"""The decode-timing helper on the simulator's runner: every timed step is a decode step of the
whole batch, timed on the engine's clock, and the engine is left empty."""
from __future__ import annotations

import pytest

from conveyor.bench.decode import start_decode_batch, time_decode_steps
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.sim.runner import SimRunner, VirtualClock
from conveyor.sim.shape import StepShape


class PrefillIsDear:
    name = "test"

    def step_time(self, shape: StepShape) -> float:
        return 0.5 if shape.prefill_tokens else 0.001 * shape.decode_tokens

    def describe(self) -> str:
        return self.name


def sim_engine(budget: int) -> LLMEngine:
    clock = VirtualClock()
    config = EngineConfig.from_kwargs(max_num_seqs=8, max_num_batched_tokens=budget)
    return LLMEngine(config, SimRunner(PrefillIsDear(), clock), num_kv_blocks=512, max_model_len=4096,
                     vocab_size=32000, clock=clock)


def test_timed_steps_are_decode_steps_of_the_whole_batch_even_after_a_long_prefill() -> None:
    engine = sim_engine(budget=64)  # 8 x 100 prompt tokens take 13 prefill steps, the first rows decode meanwhile
    timed = time_decode_steps(engine, 8, [100], steps=5)
    assert timed.step_s == pytest.approx([0.008] * 5) and timed.median_s == pytest.approx(0.008)
    assert not engine.has_unfinished_requests and engine.scheduler.kv.pool.num_used == 0


def test_contexts_are_drawn_per_request() -> None:
    engine = sim_engine(budget=2048)
    ids = start_decode_batch(engine, 6, [10, 30], steps=1, seed=3)
    lengths = {engine.scheduler.requests[i].num_prompt_tokens for i in ids}
    assert lengths == {10, 30}
    assert all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.requests.values())
