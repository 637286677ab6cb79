"""Prometheus view of the SLO controller (conveyor/control/): registered on the first step report
that carries its state, so a server without an SLO target exports none of these."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

# state key (StepStats.extra, see SloState.as_extra) -> (metric name, help)
_GAUGES = {
    "slo_batch_cap": ("conveyor:slo_batch_cap", "Running-batch cap the SLO controller has set (<= max_num_seqs)."),
    "slo_token_budget": ("conveyor:slo_token_budget", "Per-step token budget the SLO controller has set."),
    "slo_step_target_s": ("conveyor:slo_step_target_seconds", "Mean step time the controller aims at (under the TPOT target)."),
    "slo_planned_step_s": ("conveyor:slo_planned_step_seconds", "Predicted mean step time at the current cap and load."),
    "slo_predicted_step_s": ("conveyor:slo_predicted_step_seconds", "The step model's prediction for the last step."),
    "slo_measured_step_s": ("conveyor:slo_measured_step_seconds", "The last step's measured duration."),
    "slo_gain": ("conveyor:slo_gain", "Step target over TPOT target, moved by the feedback on finished requests' TPOT."),
    "slo_kv_seq_limit": ("conveyor:slo_kv_seq_limit", "Requests of the recent mean size the KV cache holds at once."),
    "slo_queue_wait_s": ("conveyor:slo_queue_wait_seconds", "How long the oldest waiting request has waited."),
}


class SloMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.gauges = {key: Gauge(name, doc, ["model_name"], registry=registry).labels(model_name)
                       for key, (name, doc) in _GAUGES.items()}
        self.ttft_misses = Counter(
            "conveyor:slo_ttft_misses", "Requests whose first token came later than the TTFT target.",
            ["model_name"], registry=registry,
        ).labels(model_name)
        self._misses_seen = 0

    def update(self, extra: dict[str, float]) -> None:
        for key, gauge in self.gauges.items():
            if key in extra:
                gauge.set(extra[key])
        misses = int(extra.get("slo_ttft_misses", 0))
        if misses > self._misses_seen:
            self.ttft_misses.inc(misses - self._misses_seen)
            self._misses_seen = misses
