"""The simulator runs speculative decoding through the real engine: proposals accepted at the
workload's rate (SimConfig.spec_acceptance), the scheduler's rollback, the cost model's rows."""
from __future__ import annotations

import pytest

from conveyor.bench.workloads import WorkloadConfig
from conveyor.errors import ConfigError
from conveyor.sim.config import SimConfig
from conveyor.sim.shape import StepShape
from conveyor.sim.simulate import run_simulation
from conveyor.request import Request
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler import SchedulerOutput

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


def simulate(acceptance: float, spec: dict | None = SPEC, num_prompts: int = 4):  # noqa: ANN201 - SimRun
    workload = WorkloadConfig("uniform", num_prompts, input_len=32, output_len=64)
    engine = dict(max_num_seqs=num_prompts, speculative_config=spec) if spec else dict(max_num_seqs=num_prompts)
    return run_simulation(SimConfig(hardware="h100", model="llama-3-8b", workload=workload, engine=engine,
                                    num_kv_blocks=512, spec_acceptance=acceptance))


def test_every_proposal_accepted_takes_one_step_per_depth_plus_one() -> None:
    plain, speculating = simulate(0.0, spec=None), simulate(1.0)
    assert plain.result.metrics.total_output == speculating.result.metrics.total_output == 4 * 64
    # 1 prefill step, then 63 tokens at 5 a step (4 proposals and the model's own) instead of 1.
    assert plain.num_steps == 64
    assert speculating.num_steps == 1 + -(-63 // 5)
    assert speculating.result.metrics.output_throughput > 3 * plain.result.metrics.output_throughput


def test_nothing_accepted_changes_no_output_and_costs_only_rows() -> None:
    plain, speculating = simulate(0.0, spec=None), simulate(0.0)
    assert speculating.result.metrics.total_output == plain.result.metrics.total_output
    assert speculating.num_steps == plain.num_steps
    assert speculating.result.metrics.output_throughput <= plain.result.metrics.output_throughput


@pytest.mark.parametrize("acceptance", [0.3, 0.8])
def test_partial_acceptance_lands_between(acceptance: float) -> None:
    run = simulate(acceptance)
    assert run.result.metrics.total_output == 4 * 64
    assert 1 + -(-63 // 5) < run.num_steps < 64


def test_a_speculating_decode_is_decode_rows_in_the_step_shape() -> None:
    request = Request("r", list(range(10)), SamplingParams(max_tokens=8), 0.0)
    request.output_token_ids = [1]
    request.num_computed_tokens = 10
    request.spec_token_ids = [2, 3]
    shape = StepShape.of(SchedulerOutput(scheduled=[(request, 3)]))
    assert (shape.decode_tokens, shape.prefill_tokens, shape.sampled) == (3, 0, 3)
    assert shape.decode_context == 11 + 12 + 13 and shape.max_decode_context == 13


def test_acceptance_must_be_a_probability() -> None:
    with pytest.raises(ConfigError, match="spec_acceptance"):
        SimConfig(spec_acceptance=1.5)
