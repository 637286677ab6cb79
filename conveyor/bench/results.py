"""One benchmark run's outcome, as `conveyor bench compare` and `conveyor simulate` produce it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.bench.metrics import BenchmarkMetrics, metrics_dict
from conveyor.bench.offline import OfflineResult


@dataclass
class RunResult:
    policy: str
    rate: float
    engine_kwargs: dict[str, Any]
    offline: OfflineResult
    metrics: BenchmarkMetrics

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, "request_rate": self.rate, "num_preemptions": self.offline.num_preemptions,
                **metrics_dict(self.metrics)}
