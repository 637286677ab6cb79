"""The offline driver on a FakeRunner engine with a virtual clock: deterministic, no model."""
from __future__ import annotations

import pytest

from conveyor.bench.offline import record_from_times, run_offline
from conveyor.bench.workloads import BenchRequest
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.request import RequestTimes
from conveyor.sim.runner import VirtualClock
from tests.fakes import FakeRunner

STEP_S, PER_TOKEN_S = 0.010, 0.001


class TimedFakeRunner(FakeRunner):
    """Each step costs STEP_S plus PER_TOKEN_S per token, on the virtual clock."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(vocab_size=1000)
        self.clock = clock

    def execute(self, out, stats):  # noqa: ANN001, ANN201 - the Runner protocol
        self.clock.now += STEP_S + PER_TOKEN_S * out.num_tokens
        return super().execute(out, stats)


def make_engine(clock: VirtualClock, policy: str, max_num_seqs: int = 4) -> LLMEngine:
    config = EngineConfig.from_kwargs(policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=256)
    return LLMEngine(config, TimedFakeRunner(clock), num_kv_blocks=256, max_model_len=1024, vocab_size=1000,
                     clock=clock)


def workload() -> list[BenchRequest]:
    # One long request among short ones: static's batch waits for it, continuous refills around it.
    outputs = [3, 30, 3, 3, 3, 3, 3, 3]
    return [BenchRequest([11 + i] * 8, n) for i, n in enumerate(outputs)]


def run(policy: str):  # noqa: ANN201 - OfflineResult
    clock = VirtualClock(100.0)
    return run_offline(make_engine(clock, policy), workload(), [0.0] * 8, sleep=clock.sleep)


def test_static_holds_its_slots_until_the_whole_batch_ends() -> None:
    result = run("static")
    records = result.records
    long_done = records[1].start + records[1].latency
    first_batch = [s for s in result.trace if s.t <= long_done + 1e-9]
    assert all(s.held == 4 for s in first_batch)  # finished members keep their slots
    assert min(s.running for s in first_batch) == 1  # ... while only the long one computes
    assert all(s.waiting == 4 for s in first_batch)  # and the queue is not touched
    for r in records[4:]:  # the second batch starts only after the long request finished
        assert r.start + r.ttft > long_done
    assert all(r.output_len == n for r, n in zip(records, [3, 30, 3, 3, 3, 3, 3, 3]))


def test_continuous_admits_waiting_requests_as_others_finish() -> None:
    static, continuous = run("static"), run("continuous")
    records = continuous.records
    long_done = records[1].start + records[1].latency
    for r in records[4:]:  # the queued requests are served while the long one still runs
        assert r.start + r.ttft < long_done
    busy = [s for s in continuous.trace if s.waiting > 0]
    assert busy and all(s.running == 4 and s.held == 4 for s in busy)  # full while there is work
    assert continuous.duration < static.duration
    assert sum(r.output_len for r in continuous.records) == sum(r.output_len for r in static.records)
    mean_ttft = lambda res: sum(r.ttft for r in res.records) / len(res.records)  # noqa: E731
    assert mean_ttft(continuous) < mean_ttft(static)


def test_requests_join_at_their_arrival_and_the_idle_engine_sleeps() -> None:
    clock = VirtualClock(100.0)
    engine = make_engine(clock, "continuous")
    arrivals = [0.5, 0.5, 3.0]
    requests = [BenchRequest([20, 21, 22], 2)] * 3
    result = run_offline(engine, requests, arrivals, sleep=clock.sleep)
    assert [r.start for r in result.records] == pytest.approx(arrivals)
    step_two_tokens = STEP_S + PER_TOKEN_S * 6  # both prompts (3 tokens each) in one step
    assert result.records[0].ttft == pytest.approx(step_two_tokens)
    assert result.records[2].ttft == pytest.approx(STEP_S + PER_TOKEN_S * 3)  # idle engine: no queueing
    assert result.duration == pytest.approx(3.0 + result.records[2].latency)
    assert result.trace[0].t == pytest.approx(0.5 + step_two_tokens)
    assert result.num_preemptions == 0
    trace = result.trace_dict()
    assert set(trace) >= {"t", "running", "held", "waiting", "num_tokens", "duration"}
    assert len(trace["t"]) == len(result.trace)


def test_record_from_engine_times() -> None:
    times = RequestTimes(arrival=10.0, first_scheduled=10.5, first_token=11.0, tokens=[11.0, 11.25, 12.0],
                         finished=12.0)
    r = record_from_times(7, times, origin=9.0)
    assert (r.start, r.ttft, r.latency, r.output_len, r.prompt_len) == (1.0, 1.0, 2.0, 3, 7)
    assert r.itl == pytest.approx([0.25, 0.75])
    assert r.tpot == pytest.approx(0.5)
    assert not record_from_times(7, RequestTimes(arrival=1.0)).success


def test_a_request_the_engine_rejects_is_a_failed_record_and_the_rest_run() -> None:
    clock = VirtualClock(100.0)
    engine = make_engine(clock, "continuous")  # 256 blocks of 16 tokens, max_model_len 1024
    requests = [BenchRequest([20] * 4, 2), BenchRequest([21] * 2000, 2), BenchRequest([22] * 4, 2)]
    result = run_offline(engine, requests, [0.0, 0.0, 0.0], sleep=clock.sleep)
    assert [r.success for r in result.records] == [True, False, True]
    assert "maximum model length" in result.records[1].error
