"""One simulated benchmark run: a workload's arrivals through the real engine on a cost model.

It is `conveyor bench compare`'s in-process run with the model swapped for a cost model: the same
offline driver (conveyor/bench/offline.py), the same metrics and the same RunResult, so the
output block, JSON, trace and plots are the real benchmark's.
"""
from __future__ import annotations

import time

from conveyor.bench.metrics import compute_metrics
from conveyor.bench.offline import run_offline
from conveyor.bench.results import RunResult
from conveyor.bench.workloads import BenchRequest, generate_requests, parse_rate_schedule, request_arrivals
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.sim.config import SimConfig, SimRun, build_cost_model, kv_pools, max_model_len, policy_label
from conveyor.sim.disagg import run_deployment
from conveyor.sim.runner import SimProposer, SimRunner, VirtualClock


def run_simulation(cfg: SimConfig, requests: list[BenchRequest] | None = None) -> SimRun:
    if cfg.prefill_workers or cfg.decode_workers or cfg.replicas != 1:  # several engines: sweeps work too
        return run_deployment(cfg, requests)
    wall0 = time.perf_counter()
    cost_model, model, hardware = build_cost_model(cfg)
    engine_config = EngineConfig.from_kwargs(**cfg.engine)
    blocks, window = kv_pools(cfg, model, hardware, engine_config)
    if requests is None:
        cfg.workload.vocab_size = model.vocab_size
        requests = generate_requests(cfg.workload)
    clock = VirtualClock()
    runner = SimRunner(cost_model, clock, cfg.spec_acceptance, cfg.workload.seed, model.sliding_window, window)
    engine = LLMEngine(engine_config, runner, num_kv_blocks=blocks,
                       max_model_len=max_model_len(cfg, model),
                       vocab_size=model.vocab_size, clock=clock, proposer=SimProposer())
    schedule = parse_rate_schedule(cfg.rate_schedule) if cfg.rate_schedule else None
    arrivals = request_arrivals(requests, cfg.request_rate, cfg.burstiness, cfg.workload.seed, schedule)
    offline = run_offline(engine, requests, arrivals, sleep=clock.sleep)
    metrics = compute_metrics(offline.records, offline.duration, cfg.percentiles, cfg.goodput or None)
    result = RunResult(policy_label(engine_config), cfg.request_rate, dict(cfg.engine), offline, metrics)
    return SimRun(result, time.perf_counter() - wall0, runner.num_steps, blocks, cost_model.describe(), kv_window=window)
