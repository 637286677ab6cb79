"""End to end: workloads through the real engine and scheduler on a virtual clock."""
from __future__ import annotations

import math

import pytest

from conveyor.bench.workloads import WorkloadConfig
from conveyor.config import EngineConfig
from conveyor.errors import ConfigError
from conveyor.sim import disagg, simulate
from conveyor.sim.config import SimConfig, kv_pools
from conveyor.sim.hardware import get_hardware
from conveyor.sim.models import get_model
from conveyor.sim.runner import SimRunner, VirtualClock
from conveyor.sim.simulate import run_simulation


class ConstantCost:
    """Every step takes `seconds`, whatever it computes."""

    name = "constant"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def step_time(self, shape) -> float:  # noqa: ANN001
        return self.seconds

    def describe(self) -> str:
        return f"constant {self.seconds}"


@pytest.fixture
def constant_cost(monkeypatch: pytest.MonkeyPatch) -> ConstantCost:
    cost = ConstantCost(0.010)
    for module in (simulate, disagg):  # each builds its engines' cost model
        monkeypatch.setattr(module, "build_cost_model", lambda cfg: (cost, get_model(cfg.model), None))
    return cost


def uniform(n: int, input_len: int = 16, output_len: int = 8) -> WorkloadConfig:
    return WorkloadConfig("uniform", n, input_len=input_len, output_len=output_len)


def test_metrics_follow_the_step_times_exactly(constant_cost: ConstantCost) -> None:
    # 4 prompts prefill together in step 1 (first tokens at 10 ms), then 7 decode steps of 10 ms.
    cfg = SimConfig(model="llama-3-8b", workload=uniform(4), engine=dict(max_num_seqs=4), num_kv_blocks=64)
    run = run_simulation(cfg)
    m = run.result.metrics
    assert (m.completed, m.failed, m.total_output) == (4, 0, 32)
    assert m.stats["ttft"].mean == pytest.approx(10.0)
    assert m.stats["tpot"].mean == pytest.approx(10.0)
    assert m.duration == pytest.approx(0.080)
    assert m.output_throughput == pytest.approx(32 / 0.080)
    assert run.num_steps == 8 and len(run.result.offline.trace) == 8


def test_queueing_shows_in_ttft_under_a_batch_cap(constant_cost: ConstantCost) -> None:
    # Cap 2: the second pair waits for the first pair's 8 steps, then takes 8 steps of its own.
    cfg = SimConfig(workload=uniform(4), engine=dict(max_num_seqs=2), num_kv_blocks=64)
    m = run_simulation(cfg).result.metrics
    assert m.stats["ttft"].mean == pytest.approx((10 + 10 + 90 + 90) / 4)
    assert m.duration == pytest.approx(0.160)


def test_static_waits_for_the_whole_batch_and_continuous_does_not(constant_cost: ConstantCost) -> None:
    # Outputs 2 and 8 alternate; with 2 slots, continuous refills the short request's slot at once.
    cfg = SimConfig(workload=WorkloadConfig("random", 8, input_len=16, output_len=5, range_ratio=0.6, seed=3),
                    engine=dict(max_num_seqs=2), num_kv_blocks=64)
    continuous = run_simulation(cfg).result.metrics
    static = run_simulation(SimConfig(**{**cfg.__dict__, "engine": dict(max_num_seqs=2, policy="static")})).result.metrics
    assert continuous.total_output == static.total_output
    assert continuous.duration < static.duration


def test_arrivals_at_a_rate_leave_idle_gaps_in_virtual_time(constant_cost: ConstantCost) -> None:
    # 1 request per second, each 8 steps of 10 ms: no queueing, TTFT is one step.
    cfg = SimConfig(workload=uniform(5), request_rate=1.0, burstiness=math.inf, num_kv_blocks=64)
    m = run_simulation(cfg).result.metrics
    assert m.stats["ttft"].mean == pytest.approx(10.0)
    assert m.duration == pytest.approx(5.0 + 0.080)  # the last arrives at 5 s and takes 8 steps


def test_roofline_run_is_self_consistent() -> None:
    cfg = SimConfig(hardware="a100", model="llama-2-13b", workload=WorkloadConfig("chat", 60, seed=4),
                    request_rate=4.0)
    run = run_simulation(cfg)
    m = run.result.metrics
    assert m.completed == 60 and m.failed == 0
    assert m.total_output == sum(r.output_len for r in run.result.offline.records)
    busy = sum(s.duration for s in run.result.offline.trace)
    assert busy <= m.duration + 1e-9
    # A decode-only step of a 13B model on an A100 reads 26 GB at 2 TB/s: TPOT is at least ~13 ms.
    assert 12.0 < m.stats["tpot"].mean < 40.0


def test_kv_pool_from_device_memory_minus_weights() -> None:
    model, h100 = get_model("llama-3-8b"), get_hardware("h100")
    cfg = SimConfig()
    expected = int(80e9 * 0.9 - model.weight_bytes) // (16 * 128 * 1024)
    engine = EngineConfig()
    assert kv_pools(cfg, model, h100, engine) == (expected, None)
    assert kv_pools(SimConfig(kv_cache_memory="2GiB"), model, h100, engine) == (2**31 // (16 * 128 * 1024), None)
    with pytest.raises(ConfigError, match="--tp"):
        kv_pools(SimConfig(model="llama-3-70b"), get_model("llama-3-70b"), h100, engine)
    assert kv_pools(SimConfig(model="llama-3-70b", tp=4), get_model("llama-3-70b"), h100, engine)[0] > 0


def test_sim_runner_tokens_are_never_eos() -> None:
    runner = SimRunner(ConstantCost(0.5), VirtualClock())
    assert runner.TOKEN not in (0, 1, 2)  # SmolLM2's special ids; Llama's EOS ids are far above 10
    with pytest.raises(ValueError):
        runner.clock.advance(-1.0)


def test_simulating_imports_no_torch() -> None:
    """The simulator runs where torch is not installed: only `simulate fit` measures the real model."""
    import subprocess
    import sys

    code = ("import sys; from conveyor.sim.config import SimConfig; from conveyor.sim.simulate import run_simulation; "
            "from conveyor.sim.cli import add_simulate_parser; from conveyor.bench.workloads import WorkloadConfig; "
            "run_simulation(SimConfig(workload=WorkloadConfig(num_prompts=2, input_len=8, output_len=2))); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_gemma_3s_window_layers_keep_their_window_in_a_pool_of_their_own() -> None:
    # As the engine does (conveyor.kv.split_kv_memory): the window pool holds every running
    # request's window, and the rest of the device's KV memory goes to the layers that see the
    # whole context, which then hold three times the tokens: more 8k-token prompts run at once.
    model, h100 = get_model("gemma-3-27b"), get_hardware("h100")
    engine = EngineConfig.from_kwargs(max_num_seqs=16)
    pool = int(80e9 * 0.9 - model.weight_bytes)
    whole, none = kv_pools(SimConfig(model="gemma-3-27b"), model, h100, EngineConfig.from_kwargs(window_kv_pool=False))
    blocks, window = kv_pools(SimConfig(model="gemma-3-27b"), model, h100, engine)
    assert none is None and whole == pool // (16 * model.kv_bytes_per_token)
    assert window is not None and window.tokens == 1024 and window.num_blocks - 1 >= 16 * (64 + 2)
    window_bytes = 16 * model.window_kv_bytes_per_token
    assert blocks * (16 * model.kv_bytes_per_token - window_bytes) + window.num_blocks * window_bytes <= pool
    assert blocks > 2.5 * whole

    def run(window_kv_pool: bool):  # noqa: ANN202
        workload = WorkloadConfig("uniform", 32, input_len=8000, output_len=64)
        return run_simulation(SimConfig(model="gemma-3-27b", workload=workload,
                                        engine=dict(max_num_seqs=16, window_kv_pool=window_kv_pool)))

    pooled, shared = run(True), run(False)
    assert (pooled.num_kv_blocks, shared.num_kv_blocks) == (blocks, whole)
    assert pooled.result.metrics.completed == shared.result.metrics.completed == 32
    assert pooled.result.metrics.output_throughput > 1.2 * shared.result.metrics.output_throughput
    assert pooled.result.offline.num_preemptions < shared.result.offline.num_preemptions


def test_a_handover_of_gemma_3_moves_only_the_window_blocks_its_prefill_worker_held() -> None:
    def run(window_kv_pool: bool):  # noqa: ANN202
        workload = WorkloadConfig("uniform", 8, input_len=8000, output_len=8)
        return run_simulation(SimConfig(model="gemma-3-27b", workload=workload, prefill_workers=1, decode_workers=1,
                                        engine=dict(max_num_seqs=8, window_kv_pool=window_kv_pool)))

    pooled, whole = run(True), run(False)
    model = get_model("gemma-3-27b")
    every_layer = 8 * 500 * 16 * model.kv_bytes_per_token  # 8 prompts of 500 blocks of 16 tokens
    assert whole.result.offline.extra["kv_transfer_bytes"] == every_layer
    # The global layers' blocks all move; the window layers' only from the last chunks the prefill
    # worker still held (its step budget of 2,048 tokens, and the window before them).
    moved = pooled.result.offline.extra["kv_transfer_bytes"]
    global_layers = every_layer * (model.num_layers - model.num_window_layers) // model.num_layers
    assert global_layers < moved < every_layer / 2
    assert pooled.result.metrics.completed == whole.result.metrics.completed == 8
