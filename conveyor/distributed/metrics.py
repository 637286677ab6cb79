"""/metrics of a Ray deployment: per-worker load and the KV handovers, beside the usual ones."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from conveyor.distributed.stats import ClusterStats


class ClusterMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name", "worker", "role"]
        self.outstanding = Gauge("conveyor:worker_outstanding_tokens",
                                 "What the router balances: queued prompt tokens plus running requests.", labels,
                                 registry=registry)
        self.running = Gauge("conveyor:worker_num_requests_running", "Requests running on the worker.", labels,
                             registry=registry)
        self.waiting = Gauge("conveyor:worker_num_requests_waiting", "Requests waiting on the worker.", labels,
                             registry=registry)
        self.kv_usage = Gauge("conveyor:worker_kv_cache_usage_perc", "KV-cache usage of the worker (0..1).", labels,
                              registry=registry)
        self.alive = Gauge("conveyor:worker_alive", "1 while the worker serves, 0 once it died.", labels,
                           registry=registry)
        self.requests = Counter("conveyor:worker_requests", "Requests whose prompt the worker computed.", labels,
                                registry=registry)
        self.prompt_tokens = Counter("conveyor:worker_prompt_tokens", "Prompt tokens of the worker's requests.",
                                     labels, registry=registry)
        self.cached_tokens = Counter("conveyor:worker_prefix_cache_hits",
                                     "Prompt tokens of the worker's requests that its prefix cache held.", labels,
                                     registry=registry)
        self._seen_totals: dict[str, tuple[int, int, int]] = {}
        self.transfers = Counter("conveyor:kv_transfers", "Requests whose KV moved from a prefill to a decode worker.",
                                 ["model_name"], registry=registry).labels(model_name)
        self.transfer_bytes = Counter("conveyor:kv_transfer_bytes", "Bytes of KV moved by handovers.",
                                      ["model_name"], registry=registry).labels(model_name)
        self.transfer_cached_bytes = Counter(
            "conveyor:kv_transfer_cached_bytes",
            "Bytes of KV handovers left out because the decode worker's prefix cache held those blocks.",
            ["model_name"], registry=registry).labels(model_name)
        self.failures = Counter("conveyor:worker_failures", "Workers that died.", ["model_name"],
                                registry=registry).labels(model_name)
        self.retries = Counter("conveyor:request_retries", "Requests resubmitted after their worker died.",
                               ["model_name"], registry=registry).labels(model_name)
        self._seen = ClusterStats()

    def update(self, cluster: ClusterStats) -> None:
        for w in cluster.workers:
            labels = (self.model_name, w.name, w.role)
            self.outstanding.labels(*labels).set(w.outstanding_tokens)
            self.running.labels(*labels).set(w.num_running)
            self.waiting.labels(*labels).set(w.num_waiting)
            self.kv_usage.labels(*labels).set(w.kv_usage)
            self.alive.labels(*labels).set(1 if w.alive else 0)
            now_totals = (w.totals.requests, w.totals.prompt_tokens, w.totals.cached_tokens)
            before_totals = self._seen_totals.get(w.name, (0, 0, 0))
            for counter, now_value, before_value in zip(
                    (self.requests, self.prompt_tokens, self.cached_tokens), now_totals, before_totals):
                if now_value > before_value:
                    counter.labels(*labels).inc(now_value - before_value)
            self._seen_totals[w.name] = now_totals
        # Counters only grow: add what is new since the last report.
        for counter, now, before in (
            (self.transfers, cluster.kv_transfers, self._seen.kv_transfers),
            (self.transfer_bytes, cluster.kv_transfer_bytes, self._seen.kv_transfer_bytes),
            (self.transfer_cached_bytes, cluster.kv_transfer_cached_bytes, self._seen.kv_transfer_cached_bytes),
            (self.failures, cluster.worker_failures, self._seen.worker_failures),
            (self.retries, cluster.retries, self._seen.retries),
        ):
            if now > before:
                counter.inc(now - before)
        self._seen = ClusterStats(kv_transfers=cluster.kv_transfers, kv_transfer_bytes=cluster.kv_transfer_bytes,
                                  kv_transfer_cached_bytes=cluster.kv_transfer_cached_bytes,
                                  worker_failures=cluster.worker_failures, retries=cluster.retries)
