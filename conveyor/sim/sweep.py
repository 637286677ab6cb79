"""Capacity planning on the simulator: the highest request rate, or the best batch cap, that meets
latency SLOs at a percentile (P99 by default), as a capacity planner sizes a deployment.

`sweep_rate` assumes latency grows with load (true of one engine fed Poisson arrivals): given no
list of rates it doubles the rate until the SLOs break, then bisects between the last rate that
met them and the first that did not. `sweep_max_num_seqs` runs each cap and keeps the one with
the highest output throughput among those that meet the SLOs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from conveyor.errors import ConfigError
from conveyor.bench.metrics import BenchmarkMetrics
from conveyor.bench.workloads import generate_requests
from conveyor.sim.config import SimConfig, SimRun
from conveyor.sim.models import get_model
from conveyor.sim.simulate import run_simulation

SLO_KEYS = ("ttft", "tpot", "itl", "e2el")


def parse_slos(pairs: Sequence[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds, at the sweep percentile)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or key not in SLO_KEYS or ms < 0:
            raise ConfigError(f"SLOs are KEY:MS with KEY one of {', '.join(SLO_KEYS)} and MS >= 0; got {pair!r}")
        slos[key] = ms
    return slos


def slo_values(metrics: BenchmarkMetrics, slos: dict[str, float], percentile: float) -> dict[str, float]:
    return {key: dict(metrics.stats[key].percentiles)[percentile] for key in slos}


def meets(metrics: BenchmarkMetrics, slos: dict[str, float], percentile: float) -> bool:
    if metrics.failed or not metrics.completed:
        return False
    return all(value <= slos[key] for key, value in slo_values(metrics, slos, percentile).items())


@dataclass
class SweepPoint:
    value: float  # the rate or the cap
    run: SimRun
    ok: bool


@dataclass
class SweepResult:
    knob: str  # "rate" or "max-num-seqs"
    points: list[SweepPoint]
    best: SweepPoint | None


def _prepare(cfg: SimConfig, slos: dict[str, float], percentile: float) -> SimConfig:
    cfg = replace(cfg, percentiles=sorted({*cfg.percentiles, percentile}))
    cfg.workload.vocab_size = get_model(cfg.model, cfg.dtype).vocab_size
    return cfg


def sweep_rate(cfg: SimConfig, slos: dict[str, float], rates: Sequence[float] | None = None, percentile: float = 99.0,
               bisections: int = 6, echo: Callable[[str], None] | None = None) -> SweepResult:
    cfg = _prepare(cfg, slos, percentile)
    requests = generate_requests(cfg.workload)
    points: list[SweepPoint] = []

    def run(rate: float) -> bool:
        sim = run_simulation(replace(cfg, request_rate=rate), requests)
        ok = meets(sim.result.metrics, slos, percentile)
        points.append(SweepPoint(rate, sim, ok))
        if echo:
            echo(format_point(points[-1], slos, percentile, "rate"))
        return ok

    if rates:
        for rate in rates:
            run(rate)
    else:
        rate = cfg.request_rate if math.isfinite(cfg.request_rate) else 1.0
        good, bad = None, None
        for _ in range(16):  # bracket: double up from a passing rate, or halve down from a failing one
            if run(rate):
                good = rate
                if bad is not None:
                    break
                rate *= 2
            else:
                bad = rate
                if good is not None:
                    break
                rate /= 2
        if good is not None and bad is not None:
            for _ in range(bisections):
                mid = (good + bad) / 2
                if run(mid):
                    good = mid
                else:
                    bad = mid
    passing = [p for p in points if p.ok]
    best = max(passing, key=lambda p: p.value) if passing else None
    return SweepResult("rate", sorted(points, key=lambda p: p.value), best)


def sweep_max_num_seqs(cfg: SimConfig, slos: dict[str, float], caps: Sequence[int], percentile: float = 99.0,
                       echo: Callable[[str], None] | None = None) -> SweepResult:
    cfg = _prepare(cfg, slos, percentile)
    requests = generate_requests(cfg.workload)
    points = []
    for cap in caps:
        sim = run_simulation(replace(cfg, engine={**cfg.engine, "max_num_seqs": int(cap)}), requests)
        sim.result.policy = f"{sim.result.policy} (max_num_seqs={cap})"
        points.append(SweepPoint(cap, sim, meets(sim.result.metrics, slos, percentile)))
        if echo:
            echo(format_point(points[-1], slos, percentile, "max-num-seqs"))
    passing = [p for p in points if p.ok]
    best = max(passing, key=lambda p: p.run.result.metrics.output_throughput) if passing else None
    return SweepResult("max-num-seqs", points, best)


def format_point(p: SweepPoint, slos: dict[str, float], percentile: float, knob: str) -> str:
    m = p.run.result.metrics
    pw = f"P{percentile:g}"
    values = " ".join(f"{pw} {k.upper()} {v:8.1f} ms" for k, v in slo_values(m, slos, percentile).items())
    return (f"{knob} {p.value:>8g} | {m.request_throughput:7.2f} req/s | {m.output_throughput:9.1f} out tok/s | "
            f"{values} | {'meets SLO' if p.ok else 'misses SLO'}")


def format_sweep(result: SweepResult, slos: dict[str, float], percentile: float) -> str:
    lines = [format_point(p, slos, percentile, result.knob) for p in result.points]
    target = ", ".join(f"P{percentile:g} {k.upper()} <= {v:g} ms" for k, v in slos.items())
    if result.best is None:
        lines.append(f"no {result.knob} tried meets {target}")
    else:
        what = "highest rate" if result.knob == "rate" else "best max-num-seqs"
        m = result.best.run.result.metrics
        lines.append(f"{what} meeting {target}: {result.best.value:.4g} "
                     f"({m.request_throughput:.2f} req/s, {m.output_throughput:.1f} output tok/s)")
    return "\n".join(lines)
