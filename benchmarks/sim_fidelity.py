"""Simulator fidelity on this machine: fit the profiled cost model, then run each workload on the
real engine and in the simulator, and print the side-by-side table.

    .venv/bin/python benchmarks/sim_fidelity.py                # ~6-10 min on 2 cores, 1 thread
    .venv/bin/python benchmarks/sim_fidelity.py --scale 2      # twice the requests

Order: profile grid, the real runs, the profile grid again; the profile is fitted to both grids
(so it spans the same minutes as the real runs: on a shared machine the load drifts), then each
workload is simulated on the same requests and arrival times, with the same scheduler settings
and KV pool. Errors are (simulated - real) / real; the target is within 15% on output throughput,
mean TTFT and mean TPOT.

"calibrated" scales the whole profile by the machine's speed measured on a few grid steps right
before and right after each real run (the "cal." factor: measured over predicted), so load that
drifted since the profile was fitted is taken out; those steps are grid steps, not the workload's.
The last column separates the two sources of error: "steps real/model" compares each real step's
measured time with what the fitted profile predicts for that very step's shape (the median of
the ratios, and total measured over total predicted). Near 1.00x, remaining error comes from the
simulation; far from it, the step costs themselves moved (machine load) or the profile misses a
feature of these steps. A median near 1 with a total well above it means stalls: a few steps
that waited behind other processes, which inflate real mean TPOT but which no cost model predicts.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from conveyor.bench.metrics import BenchmarkMetrics, compute_metrics
from conveyor.bench.offline import run_offline
from conveyor.bench.workloads import WorkloadConfig, arrival_times, describe, generate_requests
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.sim.config import SimConfig
from conveyor.sim.profile_steps import ProfileGrid, ShapeRecorder, measure
from conveyor.sim.profiled import Profile, ProfiledCostModel, fit_profile
from conveyor.sim.simulate import run_simulation


@dataclass
class Case:
    name: str
    workload: WorkloadConfig
    rate: float
    engine: dict[str, Any] = field(default_factory=dict)


def cases(scale: int) -> list[Case]:
    n = 16 * scale
    long = dict(input_len=32, output_len=48, long_prompt_len=384, long_prompt_every=4)
    return [
        Case("chat, continuous, 1 req/s", WorkloadConfig("chat", n, input_len=64, output_len=48, seed=1), 1.0,
             dict(policy="continuous", max_num_seqs=8, max_num_batched_tokens=256)),
        Case("long-prompts, chunked 128", WorkloadConfig("long-prompts", n, **long), math.inf,
             dict(policy="continuous", max_num_seqs=8, max_num_batched_tokens=128)),
        Case("long-prompts, naive", WorkloadConfig("long-prompts", n, **long), math.inf,
             dict(policy="continuous", max_num_seqs=8, max_num_batched_tokens=512, chunked_prefill=False)),
        Case("seed, static", WorkloadConfig("seed", n, input_len=48, output_len=40, seed=2), math.inf,
             dict(policy="static", max_num_seqs=8, max_num_batched_tokens=512)),
    ]


def summary(m: BenchmarkMetrics) -> dict[str, float]:
    return {"output tok/s": m.output_throughput, "mean TTFT ms": m.stats["ttft"].mean,
            "mean TPOT ms": m.stats["tpot"].mean}


def row(name: str, metric: str, real: float, sims: list[float], note: str = "") -> str:
    cells = []
    for sim in sims:
        err = (sim - real) / real * 100 if real else float("nan")
        cells.append(f"{sim:>9.1f} {err:>+7.1f}%{'' if abs(err) <= 15 else ' *':<2}")
    return f"{name:<26} {metric:<13} {real:>9.1f} {' '.join(cells)} {note:>14}"


# A few seconds of grid steps measured right before and right after each real run: the machine's
# current speed relative to the fitted profile, which the calibrated simulation scales by.
CALIBRATION = ProfileGrid(batch_sizes=[1, 4, 8], contexts=[96], prompt_lens=[128], chunk_episodes=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=1, help="multiplies the number of requests per workload")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--profile", default="out/sim/fidelity-profile.json", help="where the fitted profile is written")
    ap.add_argument("--no-second-profile", action="store_true", help="fit to the grid measured before the runs only")
    ap.add_argument("--only", nargs="*", default=None, help="run only the cases whose name contains these words")
    args = ap.parse_args()

    from conveyor.model.threads import set_num_threads
    from conveyor.runner.model_runner import load_model

    set_num_threads(args.num_threads)
    t_start = time.perf_counter()
    base = dict(num_threads=args.num_threads, kv_cache_memory="1GiB", block_size=16)
    loaded = load_model(EngineConfig.from_kwargs(**base))
    grid = ProfileGrid()

    def profile_grid(label: str) -> list:
        t0 = time.perf_counter()
        print(f"{label}: profiling the real engine over {len(grid.episodes())} episodes ({args.num_threads} thread(s)) ...")
        engine = LLMEngine.from_config(EngineConfig.from_kwargs(**base, max_num_seqs=64), loaded)
        samples = measure(engine, grid, echo=None)
        print(f"    {len(samples)} steps in {time.perf_counter() - t0:.0f} s")
        return samples

    def calibrate() -> list:
        engine = LLMEngine.from_config(EngineConfig.from_kwargs(**base, max_num_seqs=64), loaded)
        return measure(engine, CALIBRATION, echo=None)

    samples = profile_grid("before")
    chosen = [c for c in cases(args.scale) if not args.only or any(w in c.name for w in args.only)]
    real_runs = []
    for case in chosen:
        case.workload.vocab_size = loaded.model.cfg.vocab_size
        requests = generate_requests(case.workload)
        arrivals = arrival_times(len(requests), case.rate, 1.0, case.workload.seed)
        print(f"real: {case.name}: {describe(requests)}")
        engine = LLMEngine.from_config(EngineConfig.from_kwargs(**base, **case.engine), loaded)
        engine.warm_up()
        calibration = calibrate()
        recorder = ShapeRecorder(engine.runner, keep=True)
        engine.runner = recorder
        t0 = time.perf_counter()
        offline = run_offline(engine, requests, arrivals)
        print(f"    {time.perf_counter() - t0:.0f} s")
        steps = list(zip(recorder.shapes or [], [s.duration for s in offline.trace]))
        engine = None  # frees its KV cache before the calibration engine allocates one
        calibration += calibrate()
        real_runs.append((case, requests, compute_metrics(offline.records, offline.duration), steps, calibration))
    if not args.no_second_profile:
        samples += profile_grid("after")
    profile = fit_profile([s for s, _ in samples], [t for _, t in samples],
                          {"model": "smollm2-135m", "dtype": "float32", "num_threads": args.num_threads,
                           "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})
    profile.save(args.profile)
    model = ProfiledCostModel(profile)
    print(f"profile: {profile.num_samples} steps, R^2 {profile.r2:.3f}, median |error| "
          f"{100 * profile.median_abs_rel_error:.1f}%; wrote {args.profile}")

    lines = [f"{'workload':<26} {'metric':<13} {'real':>9} {'sim':>9} {'error':>8}   {'calibrated':>9} "
             f"{'error':>8}   {'steps real/model':>14}"]
    for i, (case, requests, real, steps, calibration) in enumerate(real_runs):
        level = statistics.median(t / model.step_time(s) for s, t in calibration)
        calibrated = Profile({k: v * level for k, v in profile.coefficients.items()}, profile.num_samples,
                             meta={**profile.meta, "calibration_level": level})
        sims = []
        for path in (args.profile, str(calibrated.save(f"{args.profile[:-5]}-calibrated-{i}.json"))):
            sim_cfg = SimConfig(hardware="this-machine", model="smollm2-135m", cost_model="profiled", profile=path,
                                kv_cache_memory=base["kv_cache_memory"], workload=case.workload,
                                request_rate=case.rate, engine={**case.engine, "block_size": base["block_size"]})
            sims.append(summary(run_simulation(sim_cfg, requests).result.metrics))
        ratios = [t / model.step_time(s) for s, t in steps] or [float("nan")]
        total = sum(t for _, t in steps) / max(sum(model.step_time(s) for s, _ in steps), 1e-12)
        notes = [f"median {statistics.median(ratios):.2f}x", f"total {total:.2f}x", f"cal. {level:.2f}x"]
        for note, (metric, value) in zip(notes, summary(real).items()):
            lines.append(row(case.name, metric, value, [sim[metric] for sim in sims], note))
    print("\n".join(lines))
    print(f"(* beyond 15%)  total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
