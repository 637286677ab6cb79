"""The SLO controller against fixed batch caps, under load that rises and falls, in one run.

    .venv/bin/python benchmarks/slo_controller.py --num-threads 2            # the real model, ~10-15 min
    .venv/bin/python benchmarks/slo_controller.py --sim h100 --sim-model llama-3-8b --low-cap 16 --high-cap 512

1. Calibrate: time decode steps at the low cap and the high cap (default 8 and 64) at the workload's
   typical context; the TPOT target (unless --slo-tpot-ms) is the middle of the two.
2. Size the load from that: a low rate (a quarter of what the low cap serves) for --low-s seconds, a
   peak (1.3x what the high cap serves, so every configuration saturates) for --peak-s, low again.
3. Run the same requests on the same arrival times three times back to back: the high cap fixed,
   the low cap fixed, and the controller (max_num_seqs = the high cap, slo_tpot_ms = the target).
4. Print a table and the three acceptance checks; write slo.json (summary + per-step traces) and
   slo_control.png (load, batch and cap, every request's TPOT over time).

With --sim the engine runs on the simulator's cost model and virtual clock (conveyor/sim/) instead
of the model: same scheduler, same controller, same driver; "calibration" asks the cost model.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from conveyor.bench.decode import time_decode_steps
from conveyor.bench.metrics import compute_metrics, per_request_dict
from conveyor.bench.offline import OfflineResult, run_offline
from conveyor.bench.plots import plot_slo_control
from conveyor.bench.workloads import (
    WorkloadConfig,
    arrival_times,
    describe,
    expected_arrivals,
    generate_requests,
    parse_rate_schedule,
)
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine


@dataclass
class Row:
    label: str
    output_throughput: float
    tpot_mean_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    ttft_p99_ms: float
    duration_s: float
    preemptions: int
    completed: int


# --- engines: the real model, or the simulator ------------------------------------------------------
def real_engines(args: argparse.Namespace) -> tuple[Callable[..., LLMEngine], Callable[[], None] | None]:
    from conveyor.model.threads import set_num_threads
    from conveyor.runner.model_runner import load_model

    set_num_threads(args.num_threads)
    loaded = load_model(EngineConfig.from_kwargs(model=args.model))

    def make(**kwargs: Any) -> LLMEngine:
        return LLMEngine.from_config(EngineConfig.from_kwargs(model=args.model, num_threads=args.num_threads,
                                                              **kwargs), loaded)

    return make, None


def sim_engines(args: argparse.Namespace) -> tuple[Callable[..., LLMEngine], Callable[[], None]]:
    from conveyor.sim.config import SimConfig, build_cost_model, kv_pools
    from conveyor.sim.runner import SimRunner, VirtualClock

    cfg = SimConfig(hardware=args.sim, model=args.sim_model)
    cost_model, model, hardware = build_cost_model(cfg)
    clocks: list[VirtualClock] = []

    def make(**kwargs: Any) -> LLMEngine:
        config = EngineConfig.from_kwargs(**kwargs)
        clock = VirtualClock()
        clocks.append(clock)
        blocks, window = kv_pools(cfg, model, hardware, config)
        return LLMEngine(config, SimRunner(cost_model, clock, attention_window=model.sliding_window, kv_window=window),
                         num_kv_blocks=blocks,
                         max_model_len=model.max_model_len, vocab_size=model.vocab_size, clock=clock)

    def sleep(seconds: float) -> None:
        clocks[-1].sleep(seconds)

    print(f"simulated: {args.sim_model} on {args.sim} ({cost_model.describe()})")
    return make, sleep


# --- the experiment -----------------------------------------------------------------------------------
def summarize(label: str, result: OfflineResult) -> Row:
    m = compute_metrics(result.records, result.duration, [50.0, 99.0])
    tpot, ttft = dict(m.stats["tpot"].percentiles), dict(m.stats["ttft"].percentiles)
    return Row(label, m.output_throughput, m.stats["tpot"].mean, tpot[50.0], tpot[99.0], ttft[99.0],
               result.duration, result.num_preemptions, m.completed)


def format_rows(rows: list[Row], target_ms: float) -> str:
    head = f"{'configuration':<24} {'out tok/s':>9} {'TPOT mean':>9} {'p50':>7} {'p99':>7} {'p99/target':>10} " \
           f"{'TTFT p99':>9} {'duration':>8} {'preempt':>7}"
    lines = [head]
    for r in rows:
        lines.append(f"{r.label:<24} {r.output_throughput:>9.1f} {r.tpot_mean_ms:>9.1f} {r.tpot_p50_ms:>7.1f} "
                     f"{r.tpot_p99_ms:>7.1f} {r.tpot_p99_ms / target_ms:>10.2f} {r.ttft_p99_ms:>9.0f} "
                     f"{r.duration_s:>8.1f} {r.preemptions:>7}")
    return "\n".join(lines)


def verdicts(high: Row, low: Row, slo: Row, target_ms: float) -> list[str]:
    less = 1 - low.output_throughput / slo.output_throughput
    return [
        f"[{'PASS' if abs(slo.tpot_p99_ms / target_ms - 1) <= 0.10 else 'FAIL'}] controller P99 TPOT "
        f"{slo.tpot_p99_ms:.1f} ms is within 10% of the target {target_ms:.1f} ms",
        f"[{'PASS' if high.tpot_p99_ms > target_ms else 'FAIL'}] {high.label} breaks the target "
        f"(P99 TPOT {high.tpot_p99_ms:.1f} ms)",
        f"[{'PASS' if less >= 0.15 else 'FAIL'}] {low.label} gives {100 * less:.0f}% less output throughput "
        f"than the controller (>= 15% wanted)",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="real model (default smollm2-135m)")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--sim", default=None, metavar="HARDWARE", help="run on the simulator, e.g. h100")
    p.add_argument("--sim-model", default="llama-3-8b")
    p.add_argument("--low-cap", type=int, default=8)
    p.add_argument("--high-cap", type=int, default=64)
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="default: midway between the two caps' steps")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--low-s", type=float, default=30.0, help="seconds of low load before and after the peak")
    p.add_argument("--peak-s", type=float, default=60.0, help="seconds of peak load")
    p.add_argument("--peak-factor", type=float, default=1.3, help="peak load over what the high cap serves")
    p.add_argument("--low-factor", type=float, default=0.25, help="low load over what the low cap serves")
    p.add_argument("--rate-schedule", default=None, help="override the sized schedule, e.g. 0:0.2,30:2.5,90:0.2")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="out/slo")
    args = p.parse_args()

    make, sim_sleep = sim_engines(args) if args.sim else real_engines(args)
    sleep = sim_sleep or time.sleep
    common = dict(max_num_batched_tokens=args.max_num_batched_tokens)
    context = args.input_len + args.output_len // 2

    probe = make(max_num_seqs=args.high_cap, **common)
    if not args.sim:
        probe.warm_up()
    t_low, t_high = (time_decode_steps(probe, b, [context], steps=6).median_s for b in (args.low_cap, args.high_cap))
    del probe
    target_ms = args.slo_tpot_ms or 1000 * (t_low + t_high) / 2
    print(f"decode step at context {context}: batch {args.low_cap} {1000 * t_low:.1f} ms, batch {args.high_cap} "
          f"{1000 * t_high:.1f} ms -> TPOT target {target_ms:.1f} ms")

    if args.rate_schedule:
        schedule = parse_rate_schedule(args.rate_schedule)
        span = schedule[-1][0] + args.low_s
    else:
        low_rate = args.low_factor * args.low_cap / t_low / args.output_len
        peak_rate = args.peak_factor * args.high_cap / t_high / args.output_len
        schedule = [(0.0, low_rate), (args.low_s, peak_rate), (args.low_s + args.peak_s, low_rate)]
        span = 2 * args.low_s + args.peak_s
    num = max(1, round(expected_arrivals(schedule, span)))
    text = ",".join(f"{s:g}:{r:.3g}" for s, r in schedule)
    workload = WorkloadConfig(dataset="random", num_prompts=num, input_len=args.input_len,
                              output_len=args.output_len, range_ratio=args.range_ratio, seed=args.seed,
                              vocab_size=49152 if not args.sim else 32000)
    requests = generate_requests(workload)
    arrivals = arrival_times(num, 1.0, seed=args.seed, schedule=schedule)
    work = sum(r.output_len for r in requests)
    print(f"rate schedule {text} (start s:req/s); {describe(requests)}")
    if not args.sim:
        estimate = span + work / (args.low_cap / t_low) + 2 * work / (0.6 * args.high_cap / t_high)
        print(f"expected wall time roughly {estimate / 60:.0f} min")

    configs = [(f"fixed cap {args.high_cap}", dict(max_num_seqs=args.high_cap)),
               (f"fixed cap {args.low_cap}", dict(max_num_seqs=args.low_cap)),
               (f"SLO {target_ms:.0f} ms (cap<={args.high_cap})", dict(max_num_seqs=args.high_cap,
                                                                      slo_tpot_ms=target_ms))]
    rows, runs = [], []
    for label, kwargs in configs:
        engine = make(**common, **kwargs)
        if not args.sim:
            engine.warm_up()
        wall = time.perf_counter()
        result = run_offline(engine, requests, arrivals, sleep=sleep)
        rows.append(summarize(label, result))
        runs.append((label, result))
        print(f"{label}: done in {time.perf_counter() - wall:.0f} s wall", flush=True)
        del engine
        gc.collect()

    table = format_rows(rows, target_ms)
    checks = verdicts(rows[0], rows[1], rows[2], target_ms)
    print(table + "\n" + "\n".join(checks))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot = plot_slo_control(runs, target_ms / 1000, out / "slo_control.png")
    (out / "slo.json").write_text(json.dumps({
        "args": vars(args), "rate_schedule": text, "decode_step_s": {args.low_cap: t_low, args.high_cap: t_high},
        "target_ms": target_ms, "table": table, "checks": checks, "rows": [asdict(r) for r in rows],
        "runs": [{"label": label, "trace": r.trace_dict(), **per_request_dict(r.records)} for label, r in runs],
    }, default=lambda x: None if isinstance(x, float) and not math.isfinite(x) else str(x)))
    print(f"wrote {out / 'slo.json'}, {plot}")


if __name__ == "__main__":
    main()
