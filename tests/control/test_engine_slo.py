"""The controller inside LLMEngine, on a FakeRunner whose steps cost virtual time: under load that
rises and falls it holds the TPOT target, preempts nobody, and beats a cap that is too low."""
from __future__ import annotations

import numpy as np
import pytest

from conveyor.bench.metrics import compute_metrics
from conveyor.bench.offline import OfflineResult, run_offline
from conveyor.bench.workloads import WorkloadConfig, arrival_times, generate_requests, parse_rate_schedule
from conveyor.config import EngineConfig
from conveyor.errors import ConfigError
from conveyor.sampling.params import SamplingParams
from conveyor.sim.runner import VirtualClock
from tests.control.synthetic import LinearCost, make_engine

TARGET_MS = 180.0  # between the synthetic cost's steps at batch 8 (~95 ms) and 64 (~270 ms)


def run(noise: float = 0.05, **engine_kwargs: object) -> OfflineResult:
    workload = WorkloadConfig(dataset="random", num_prompts=120, input_len=96, output_len=64, range_ratio=0.5,
                              vocab_size=1000)
    requests = generate_requests(workload)
    arrivals = arrival_times(len(requests), 1.0, schedule=parse_rate_schedule("0:0.5,10:6,30:0.5"))
    clock = VirtualClock()
    engine = make_engine(clock, LinearCost(), noise=noise, **engine_kwargs)
    return run_offline(engine, requests, arrivals, sleep=clock.sleep)


def tpot_p99_ms(result: OfflineResult) -> float:
    return float(np.percentile([r.tpot for r in result.records if r.tpot is not None], 99)) * 1000


def throughput(result: OfflineResult) -> float:
    return compute_metrics(result.records, result.duration).output_throughput


@pytest.fixture(scope="module")
def runs() -> dict[str, OfflineResult]:
    return {"high": run(max_num_seqs=64), "low": run(max_num_seqs=8),
            "slo": run(max_num_seqs=64, slo_tpot_ms=TARGET_MS)}


def test_controller_holds_the_target_where_a_high_cap_breaks_it(runs):
    assert tpot_p99_ms(runs["high"]) > 1.2 * TARGET_MS
    assert 0.85 * TARGET_MS <= tpot_p99_ms(runs["slo"]) <= 1.1 * TARGET_MS


def test_controller_beats_a_cap_that_is_too_low(runs):
    assert throughput(runs["slo"]) > 1.15 * throughput(runs["low"])
    assert all(r.success for r in runs["slo"].records)


def test_lowering_the_cap_preempts_nobody_and_the_batch_respects_it(runs):
    trace = runs["slo"].trace
    assert runs["slo"].num_preemptions == 0
    assert min(s.slo_batch_cap for s in trace) < 64  # it did bind
    # The batch never grows past the cap in force when it was scheduled (the previous step's).
    for before, step in zip(trace, trace[1:]):
        if step.running > before.running:
            assert step.running <= max(before.slo_batch_cap, before.running)
        assert step.num_tokens <= before.slo_token_budget


def test_trace_carries_the_controller_state_and_plain_runs_do_not(runs):
    s = runs["slo"].trace[-1]
    assert s.slo_batch_cap >= 1 and s.slo_token_budget >= 1
    assert s.slo_measured_step_s > 0 and s.slo_predicted_step_s > 0 and s.slo_planned_step_s > 0
    assert runs["high"].trace[-1].slo_batch_cap is None


def test_ttft_misses_and_queue_wait_are_visible_and_nobody_is_dropped():
    clock = VirtualClock()
    engine = make_engine(clock, LinearCost(), max_num_seqs=64, slo_tpot_ms=TARGET_MS, slo_ttft_ms=500.0)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    for i in range(40):  # a burst the cap will not take at once
        engine.add_request([11 + i] * 64, params, request_id=str(i))
    waits, finished = [], 0
    while engine.has_unfinished_requests:
        finished += sum(o.finished for o in engine.step())
        waits.append(engine.last_step.extra["slo_queue_wait_s"])
    state = engine.slo.state
    assert finished == 40
    assert max(waits) > 0.5  # someone waited longer than the TTFT target ...
    assert state.ttft_misses > 0  # ... and it was counted
    assert state.ttft_misses <= 40


def test_slo_options_reach_the_engine_from_flat_kwargs():
    config = EngineConfig.from_kwargs(max_num_seqs=32, slo_tpot_ms=150, slo_ttft_ms=2000)
    assert (config.scheduler.slo_tpot_ms, config.scheduler.slo_ttft_ms) == (150, 2000)
    engine = make_engine(VirtualClock(), LinearCost(), max_num_seqs=32, slo_tpot_ms=150)
    assert engine.slo is not None and engine.slo.config.tpot_target_s == pytest.approx(0.15)
    assert engine.slo.config.max_num_seqs == 32
    assert make_engine(VirtualClock(), LinearCost()).slo is None
    for bad in (0, -5, float("inf"), "fast"):
        with pytest.raises(ConfigError):
            EngineConfig.from_kwargs(slo_tpot_ms=bad)
