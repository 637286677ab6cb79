"""/metrics exports the SLO controller's state once an engine with a target reports it."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from conveyor.api.metrics import Metrics
from conveyor.engine.async_engine import StepReport
from conveyor.runner.stats import StepStats
from conveyor.sampling.params import SamplingParams
from conveyor.sim.runner import VirtualClock
from tests.control.synthetic import LinearCost, make_engine


def samples(metrics: Metrics) -> dict[str, float]:
    text = metrics.render()[0].decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def report(stats: StepStats) -> StepReport:
    return StepReport(num_running=1, num_waiting=0, kv_usage=0.1, num_preemptions=0, stats=stats)


def test_gauges_follow_the_engine_and_ttft_misses_count_up():
    clock = VirtualClock()
    engine = make_engine(clock, LinearCost(), max_num_seqs=64, slo_tpot_ms=150, slo_ttft_ms=200)
    for i in range(30):
        engine.add_request([11 + i] * 64, SamplingParams(max_tokens=8, ignore_eos=True))
    metrics = Metrics("m")
    while engine.has_unfinished_requests:
        engine.step()
        metrics.on_report(report(engine.last_step))
    got, state = samples(metrics), engine.slo.state
    assert got["conveyor:slo_batch_cap"] == state.batch_cap
    assert got["conveyor:slo_token_budget"] == state.token_budget
    assert got["conveyor:slo_measured_step_seconds"] == state.measured_step_s > 0
    assert got["conveyor:slo_predicted_step_seconds"] == state.predicted_step_s
    assert got["conveyor:slo_planned_step_seconds"] == state.planned_step_s
    assert got["conveyor:slo_step_target_seconds"] == state.step_target_s
    assert "conveyor:slo_queue_wait_seconds" in got
    assert got["conveyor:slo_ttft_misses_total"] == state.ttft_misses > 0


def test_misses_are_counted_as_deltas_of_the_cumulative_count():
    metrics = Metrics("m")
    for misses in (0, 2, 2, 5):
        metrics.on_report(report(StepStats(num_requests=1, extra={"slo_batch_cap": 4.0, "slo_ttft_misses": misses})))
    assert samples(metrics)["conveyor:slo_ttft_misses_total"] == 5


def test_no_slo_metrics_without_a_target():
    metrics = Metrics("m")
    metrics.on_report(report(StepStats(num_requests=3, num_tokens=3)))
    assert not any(name.startswith("conveyor:slo_") for name in samples(metrics))
