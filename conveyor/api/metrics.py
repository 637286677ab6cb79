"""Prometheus metrics, named like vLLM's (`vllm:` -> `conveyor:`) so existing dashboards map over.

Everything is updated on the event loop from the loop thread's per-iteration StepReport, so the
step loop pays nothing for it beyond building the report.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST, GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge,
    Histogram, generate_latest,
)

from conveyor.api.slo_metrics import SloMetrics
from conveyor.engine.async_engine import StepReport
from conveyor.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0,
)
_TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
FINISH_REASONS = ("stop", "length", "abort")


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        # The process's own series, as vLLM's /metrics has them from prometheus_client's default
        # registry: process_resident_memory_bytes (what this server holds), CPU seconds, open
        # files, python_info, python_gc_* (of the serving process; a Ray deployment's workers are apart).
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("conveyor:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("conveyor:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("conveyor:kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.")
        self.preemptions = counter("conveyor:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("conveyor:prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = counter("conveyor:generation_tokens", "Generated tokens.")
        self.prefix_cache_queries = counter(
            "conveyor:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (when a request starts).")
        self.prefix_cache_hits = counter(
            "conveyor:prefix_cache_hits", "Prompt tokens whose KV the prefix cache held (when a request starts).")
        success = Counter(
            "conveyor:request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"],
            registry=r,
        )
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        rejected = Counter(
            "conveyor:request_rejected", "Requests refused before reaching the engine.", ["model_name", "reason"],
            registry=r,
        )
        self.rejected = lambda reason: rejected.labels(model_name, reason)
        self.ttft = histogram("conveyor:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = histogram(
            "conveyor:time_per_output_token_seconds", "Mean time per output token after the first, per request.",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.itl = histogram("conveyor:inter_token_latency_seconds", "Time between two output tokens.",
                             _TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("conveyor:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue_time = histogram("conveyor:request_queue_time_seconds", "Arrival to first scheduled.",
                                    _LATENCY_BUCKETS)
        self.batch_size = histogram("conveyor:batch_size", "Requests in the batch of one step.", _COUNT_BUCKETS)
        self.step_tokens = histogram("conveyor:iteration_tokens_total", "Tokens computed in one step.",
                                     _COUNT_BUCKETS)
        self.spec_drafts = counter("conveyor:spec_decode_num_drafts",
                                   "Speculative decoding: requests' proposals verified (one per request a step).")
        self.spec_draft_tokens = counter("conveyor:spec_decode_num_draft_tokens",
                                         "Speculative decoding: proposed tokens verified.")
        self.spec_accepted_tokens = counter("conveyor:spec_decode_num_accepted_tokens",
                                            "Speculative decoding: proposed tokens the model accepted.")
        accepted_per_pos = Counter("conveyor:spec_decode_num_accepted_tokens_per_pos",
                                   "Speculative decoding: proposals accepted at each depth (0: the first).",
                                   ["model_name", "position"], registry=r)
        self.spec_accepted_per_pos = lambda position: accepted_per_pos.labels(model_name, str(position))
        self._preemptions_seen = 0
        self.slo: SloMetrics | None = None  # registered once a step reports the SLO controller's state
        self._model_name = model_name
        self._cluster: Any = None  # ClusterMetrics, made on the first report of a Ray deployment

    def on_report(self, report: StepReport) -> None:
        if report.cluster is not None:
            if self._cluster is None:
                from conveyor.distributed.metrics import ClusterMetrics

                self._cluster = ClusterMetrics(self.registry, self._model_name)
            self._cluster.update(report.cluster)
        self.running.set(report.num_running)
        self.waiting.set(report.num_waiting)
        self.kv_usage.set(report.kv_usage)
        if report.num_preemptions > self._preemptions_seen:
            self.preemptions.inc(report.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = report.num_preemptions
        if report.num_prompt_tokens:
            self.prompt_tokens.inc(report.num_prompt_tokens)
        if report.num_aborted:
            self.success["abort"].inc(report.num_aborted)
        if report.stats is not None and report.stats.num_requests:
            self.batch_size.observe(report.stats.num_requests)
            self.step_tokens.observe(report.stats.num_tokens)
        if report.stats is not None and report.stats.num_drafts:
            self.spec_drafts.inc(report.stats.num_drafts)
            self.spec_draft_tokens.inc(report.stats.num_draft_tokens)
            self.spec_accepted_tokens.inc(report.stats.num_accepted_tokens)
            for position, count in enumerate(report.stats.accepted_per_position):
                self.spec_accepted_per_pos(position).inc(count)
        if report.stats is not None and "slo_batch_cap" in report.stats.extra:
            self.slo = self.slo or SloMetrics(self.registry, self._model_name)
            self.slo.update(report.stats.extra)
        generated = 0
        for out in report.outputs:
            generated += len(out.new_token_ids)
            if len(out.token_ids) == len(out.new_token_ids) and out.index == 0:  # a request's first token
                self.prefix_cache_queries.inc(len(out.prompt_token_ids))
                self.prefix_cache_hits.inc(out.num_cached_tokens)
            if out.finished:
                self._observe_finished(out)
        if generated:
            self.generation_tokens.inc(generated)

    def _observe_finished(self, out: RequestOutput) -> None:
        reason = out.finish_reason or "stop"
        if reason in self.success:
            self.success[reason].inc()
        t = out.times
        if t is None:
            return
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
        if t.first_scheduled is not None:
            self.queue_time.observe(t.first_scheduled - t.arrival)
        if t.finished is not None:
            self.e2e.observe(t.finished - t.arrival)
            if t.first_token is not None and len(out.token_ids) > 1:
                self.tpot.observe((t.finished - t.first_token) / (len(out.token_ids) - 1))
        for before, after in zip(t.tokens, t.tokens[1:]):
            self.itl.observe(after - before)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
