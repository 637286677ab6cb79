"""Capacity planning: the rate search and the cap choice."""
from __future__ import annotations

import pytest

from conveyor.bench.metrics import BenchmarkMetrics, Stats
from conveyor.bench.workloads import WorkloadConfig
from conveyor.sim import sweep
from conveyor.sim.config import SimConfig
from conveyor.sim.sweep import meets, parse_slos, sweep_max_num_seqs, sweep_rate


def fake_metrics(ttft_p99_ms: float, tokens_per_s: float = 100.0) -> BenchmarkMetrics:
    stat = Stats(ttft_p99_ms, ttft_p99_ms, 0.0, [(99.0, ttft_p99_ms)])
    return BenchmarkMetrics(1.0, 10, 0, 0, 0, 10.0, None, tokens_per_s, 0.0, 0.0, 1,
                            {k: stat for k in ("ttft", "tpot", "itl", "e2el")})


class FakeRun:
    def __init__(self, metrics: BenchmarkMetrics) -> None:
        self.result = type("R", (), {"metrics": metrics, "policy": "continuous"})()


def test_rate_search_finds_the_highest_rate_on_a_monotone_curve(monkeypatch: pytest.MonkeyPatch) -> None:
    tried = []

    def fake_run(cfg, requests=None):  # noqa: ANN001, ANN202 - P99 TTFT = 10 ms per req/s
        tried.append(cfg.request_rate)
        return FakeRun(fake_metrics(10.0 * cfg.request_rate))

    monkeypatch.setattr(sweep, "run_simulation", fake_run)
    result = sweep_rate(SimConfig(workload=WorkloadConfig(num_prompts=2)), {"ttft": 55.0})
    assert 5.5 - 4 / 2**6 <= result.best.value <= 5.5  # bracketed in [4, 8], then 6 bisections
    assert tried[:4] == [1.0, 2.0, 4.0, 8.0]
    assert all(p.ok == (p.value <= 5.5) for p in result.points)


def test_rate_search_halves_when_the_first_rate_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweep, "run_simulation", lambda cfg, requests=None: FakeRun(fake_metrics(100.0 * cfg.request_rate)))
    result = sweep_rate(SimConfig(workload=WorkloadConfig(num_prompts=2), request_rate=8.0), {"ttft": 30.0})
    assert 0.3 - 0.25 / 2**6 <= result.best.value <= 0.3


def test_given_rates_pick_the_highest_passing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweep, "run_simulation", lambda cfg, requests=None: FakeRun(fake_metrics(10.0 * cfg.request_rate)))
    result = sweep_rate(SimConfig(workload=WorkloadConfig(num_prompts=2)), {"ttft": 35.0}, rates=[1, 2, 3, 4, 5])
    assert result.best.value == 3


def test_cap_sweep_on_the_real_scheduler_keeps_the_best_cap_meeting_the_slo() -> None:
    cfg = SimConfig(hardware="h100", model="llama-3-8b", workload=WorkloadConfig("chat", 48, output_len=64, seed=5),
                    request_rate=float("inf"))
    result = sweep_max_num_seqs(cfg, {"tpot": 1000.0}, caps=[2, 8, 32])
    tput = [p.run.result.metrics.output_throughput for p in result.points]
    assert tput[0] < tput[1] < tput[2]  # below the knee, a bigger batch is more throughput
    assert result.best.value == 32
    tight = sweep_max_num_seqs(cfg, {"tpot": 0.001}, caps=[2, 8])
    assert tight.best is None and not any(p.ok for p in tight.points)


def test_slo_parsing_and_checks() -> None:
    assert parse_slos(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["ttft"], ["speed:3"], ["tpot:-1"], ["tpot:x"]):
        with pytest.raises(ValueError):
            parse_slos(bad)
    assert meets(fake_metrics(10.0), {"ttft": 10.0}, 99.0)
    assert not meets(fake_metrics(10.1), {"ttft": 10.0}, 99.0)
