"""Per-worker load and KV-transfer counters of a Ray deployment, as /metrics reports them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from conveyor.distributed.router import Assignment, WorkerHandle, outstanding_tokens
from conveyor.runner.stats import StepStats


@dataclass
class WorkerTotals:
    """Since the start: the requests whose prompt the worker computed, how many prompt tokens they
    had and how many of those its prefix cache held (what cache-aware routing is judged by)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class WorkerStats:
    name: str
    role: str
    alive: bool
    outstanding_tokens: int  # what the router balances: queued prompt tokens + running requests
    num_running: int
    num_waiting: int
    kv_usage: float
    totals: WorkerTotals = field(default_factory=WorkerTotals)


@dataclass
class ClusterStats:
    workers: list[WorkerStats] = field(default_factory=list)
    kv_transfers: int = 0  # cumulative handovers that completed
    kv_transfer_bytes: int = 0  # moved
    kv_transfer_cached_bytes: int = 0  # left out: the decode worker's prefix cache held those blocks
    worker_failures: int = 0
    retries: int = 0  # requests resubmitted to another worker after theirs died
    totals: dict[str, WorkerTotals] = field(default_factory=dict)  # by worker name


def summarize(report: Any, workers: Sequence[WorkerHandle], requests: Iterable[Assignment],
              cluster: ClusterStats) -> None:
    """Fill a StepReport's engine-wide figures from the workers' last load reports (sums over the
    live ones; preemptions are cumulative, so dead workers' count stays in) and attach `cluster`."""
    requests = list(requests)
    live = [w.last_load for w in workers if w.alive and w.last_load is not None]
    report.num_running = sum(load.num_running for load in live)
    report.num_waiting = sum(load.num_waiting for load in live)
    report.kv_usage = sum(load.kv_usage for load in live) / max(1, len(live))
    report.num_preemptions = sum(w.last_load.num_preemptions for w in workers if w.last_load is not None)
    cluster.workers = [
        WorkerStats(
            w.name, w.role, w.alive, outstanding_tokens(w, requests),
            w.last_load.num_running if w.last_load else 0, w.last_load.num_waiting if w.last_load else 0,
            w.last_load.kv_usage if w.last_load else 0.0, cluster.totals.setdefault(w.name, WorkerTotals()),
        )
        for w in workers
    ]
    report.cluster = cluster


def step_stats(worker: str, steps: Sequence[tuple[int, int, dict[str, float]]],
               slo_misses: dict[str, float]) -> list[StepStats]:
    """A worker's steps as StepStats, their `extra` (the SLO controller's state) kept for /metrics.
    The gauges show the reporting worker's state; TTFT misses, a per-worker running count, become
    the sum over the workers (`slo_misses` remembers each one's last count)."""
    out = []
    for num_requests, num_tokens, extra in steps:
        if "slo_ttft_misses" in extra:
            slo_misses[worker] = extra["slo_ttft_misses"]
            extra = {**extra, "slo_ttft_misses": sum(slo_misses.values())}
        out.append(StepStats(num_requests, num_tokens, extra=extra))
    return out
