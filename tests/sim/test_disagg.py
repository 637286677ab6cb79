"""Several simulated engines: prefill/decode disaggregation and colocated replicas (conveyor/sim/disagg.py)."""
from __future__ import annotations

import math

import pytest

from conveyor.bench.workloads import WorkloadConfig
from conveyor.cli import main
from conveyor.errors import ConfigError
from conveyor.kv.manager import blocks_for
from conveyor.sim import disagg as sim_disagg
from conveyor.sim import simulate
from conveyor.sim.config import SimConfig, SimRun
from conveyor.sim.models import get_model
from conveyor.sim.shape import StepShape
from conveyor.sim.simulate import run_simulation


class SplitCost:
    """A step with a prompt chunk costs `prefill` seconds, a decode-only step `decode` seconds."""

    name = "split"

    def __init__(self, prefill: float = 0.020, decode: float = 0.010) -> None:
        self.prefill, self.decode = prefill, decode

    def step_time(self, shape: StepShape) -> float:
        return self.prefill if shape.prefill_tokens else self.decode

    def describe(self) -> str:
        return "split"


@pytest.fixture
def split_cost(monkeypatch: pytest.MonkeyPatch) -> SplitCost:
    cost = SplitCost()
    for module in (simulate, sim_disagg):  # each builds its engines' cost model
        monkeypatch.setattr(module, "build_cost_model", lambda cfg: (cost, get_model(cfg.model), None))
    return cost


def disagg(workload: WorkloadConfig, p: int = 1, d: int = 1, **kw) -> SimConfig:  # noqa: ANN003
    return SimConfig(workload=workload, prefill_workers=p, decode_workers=d, num_kv_blocks=2048, **kw)


def long_prompts(n: int = 48) -> WorkloadConfig:
    return WorkloadConfig("long-prompts", n, long_prompt_len=512, long_prompt_every=6)


def test_every_request_completes_with_its_token_count(split_cost: SplitCost) -> None:
    workload = long_prompts()
    run = run_simulation(disagg(workload, request_rate=20.0))
    records = run.result.offline.records
    from conveyor.bench.workloads import generate_requests

    wanted = [r.output_len for r in generate_requests(workload)]
    assert run.result.metrics.completed == len(wanted) and run.result.metrics.failed == 0
    assert [r.output_len for r in records] == wanted
    assert all(len(r.itl) == r.output_len - 1 for r in records)
    assert run.result.metrics.total_output == sum(wanted)


def test_ttft_is_the_prefill_workers_and_decodes_stay_on_the_decode_worker(split_cost: SplitCost) -> None:
    workload = long_prompts()
    run = run_simulation(disagg(workload, request_rate=math.inf))
    prefill, decode = run.workers
    prompt_tokens = sum(r.prompt_len for r in run.result.offline.records)
    # The prefill worker computed exactly the prompts (no decode rows), the decode worker one token per row.
    assert sum(s.num_tokens for s in prefill.trace) == prompt_tokens
    assert all(s.num_tokens == s.running for s in decode.trace)
    # TTFT is the prefill worker's first-token time: a whole number of its 20 ms steps, never a 10 ms decode.
    for r in run.result.offline.records:
        steps = r.ttft / split_cost.prefill
        assert steps == pytest.approx(round(steps)) and round(steps) >= 1


def test_kv_transfer_time_adds_to_the_first_decode_gap(split_cost: SplitCost) -> None:
    model = get_model("llama-3-8b")
    nbytes = blocks_for(64, 16) * 16 * model.kv_bytes_per_token
    workload = WorkloadConfig("uniform", 1, input_len=64, output_len=5)
    colocated = run_simulation(SimConfig(workload=workload, num_kv_blocks=2048)).result.offline.records[0]
    run = run_simulation(disagg(workload, kv_transfer_bandwidth=nbytes / 0.005))  # a 5 ms handover
    record = run.result.offline.records[0]
    assert record.ttft == pytest.approx(colocated.ttft) == pytest.approx(0.020)
    assert record.itl == pytest.approx([0.015, 0.010, 0.010, 0.010])
    assert colocated.itl == pytest.approx([0.010] * 4)
    assert run.result.offline.extra["kv_transfer_bytes"] == nbytes


def test_kv_blocks_return_to_zero_on_both_sides(split_cost: SplitCost) -> None:
    run = run_simulation(disagg(long_prompts(), p=2, d=2, request_rate=40.0))
    assert len(run.workers) == 4
    for worker in run.workers:
        kv = worker.engine.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks and not kv.block_tables and not worker.parked


def test_routing_spreads_load_over_prefill_and_decode_workers(split_cost: SplitCost) -> None:
    run = run_simulation(disagg(long_prompts(96), p=2, d=3, request_rate=math.inf))
    counts = {w.name: w.num_requests for w in run.workers}
    assert sum(counts[f"prefill{k}"] for k in range(2)) == 96
    assert sum(counts[f"decode{k}"] for k in range(3)) == 96  # every request has more than one token
    assert all(count >= 96 // 5 for count in counts.values()), counts


def test_replicas_split_the_arrivals_on_equal_hardware(split_cost: SplitCost) -> None:
    run: SimRun = run_simulation(SimConfig(workload=long_prompts(), replicas=2, num_kv_blocks=2048,
                                           request_rate=20.0))
    assert [w.name for w in run.workers] == ["replica0", "replica1"]
    assert all(w.num_requests >= 12 for w in run.workers)
    assert run.result.metrics.completed == 48 and run.result.offline.extra["devices"] == 2
    assert run.result.policy == "2x continuous"


def test_one_request_of_one_token_finishes_on_the_prefill_worker(split_cost: SplitCost) -> None:
    run = run_simulation(disagg(WorkloadConfig("uniform", 3, input_len=32, output_len=1)))
    assert run.result.metrics.completed == 3 and run.result.offline.extra["handovers"] == 0


@pytest.mark.parametrize("kw", [dict(prefill_workers=1), dict(prefill_workers=1, decode_workers=1, replicas=2),
                                dict(replicas=0), dict(prefill_workers=1, decode_workers=1,
                                                       engine=dict(policy="static"))])
def test_bad_deployments_are_refused(split_cost: SplitCost, kw: dict) -> None:
    with pytest.raises(ConfigError):
        run_simulation(SimConfig(workload=long_prompts(), num_kv_blocks=2048, **kw))


def test_cli_reports_the_deployment_and_its_hardware(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--hardware", "h100", "--model", "llama-3-8b", "--dataset", "long-prompts",
                 "--num-prompts", "24", "--rate", "10", "--prefill-workers", "1", "--decode-workers", "1",
                 "--kv-transfer-bandwidth", "400"])
    out = capsys.readouterr().out
    assert code == 0 and "Successful requests:                     24" in out
    assert "deployment: 1P+1D continuous on 2 x h100, 1 for one colocated engine" in out
    assert "at 400 GB/s per device" in out


def test_one_lane_reproduces_run_offline(split_cost: SplitCost) -> None:
    from conveyor.sim.disagg import run_deployment

    cfg = SimConfig(workload=long_prompts(), num_kv_blocks=2048, request_rate=30.0)
    alone, lane = run_simulation(cfg).result.offline.records, run_deployment(cfg).result.offline.records
    for a, b in zip(alone, lane, strict=True):
        assert (b.ttft, b.latency, b.output_len) == pytest.approx((a.ttft, a.latency, a.output_len))
        assert b.itl == pytest.approx(a.itl)
