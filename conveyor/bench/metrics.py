"""Serving metrics exactly as `vllm bench serve` defines, prints and saves them.

Per request: TTFT = first token time - send time; ITL = each gap between consecutive tokens
(streamed chunks); E2EL = last token time - send time; TPOT = (E2EL - TTFT) / (output_len - 1),
only for requests with more than one output token. Aggregates are numpy's mean / median / std /
percentile (linear interpolation) over requests (TTFT, TPOT, E2EL) or over all gaps (ITL).
Goodput counts the successful requests meeting every SLO given (TPOT counts as 0 for a request of
one token), divided by the benchmark duration.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from conveyor.errors import ConfigError

METRICS = {  # key: (short name, section header)
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """One request as a client saw it; times in seconds on any one clock."""

    prompt_len: int
    output_len: int = 0  # tokens generated
    start: float = 0.0  # when it was sent (offline: its arrival time)
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    success: bool = True
    error: str = ""
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache held, if it says (usage)

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    def token_times(self) -> list[float]:
        """Absolute time of each token (chunk): start + TTFT, then each gap."""
        if not self.success:
            return []
        return (self.start + self.ttft + np.concatenate([[0.0], np.cumsum(self.itl)])).tolist()


@dataclass
class Stats:
    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> "Stats":
        ms = np.asarray(values_s if len(values_s) else [0.0], dtype=float) * 1000.0
        return cls(float(np.mean(ms)), float(np.median(ms)), float(np.std(ms)),
                   [(p, float(np.percentile(ms, p))) for p in percentiles])


@dataclass
class BenchmarkMetrics:
    duration: float
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, Stats]  # "ttft", "tpot", "itl", "e2el"


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep or name not in GOODPUT_KEYS:
            raise ConfigError(f"goodput SLOs are KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}; got {pair!r}")
        slos[name] = float(value)
        if slos[name] < 0:
            raise ConfigError(f"goodput SLO {pair!r} must be non-negative")
    return slos


def _is_good(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(slo / 1000.0 >= values[name] for name, slo in slos_ms.items())


def _peaks(records: list[RequestRecord]) -> tuple[float, int]:
    """Most output tokens in one whole second of the run, and most requests in flight at one instant
    (a request that ends as the next begins, as with --max-concurrency 1, does not overlap it)."""
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0, 0
    t0 = min(r.start for r in ok)
    seconds = int(np.ceil(max(r.start + r.latency for r in ok) - t0)) + 1
    tokens = np.zeros(seconds)
    for r in ok:
        for t in r.token_times():
            if 0 <= int(t - t0) < seconds:
                tokens[int(t - t0)] += 1
    # Ends sort before starts at the same instant: (time, -1) < (time, +1).
    events = sorted([(r.start, 1) for r in ok] + [(r.start + r.latency, -1) for r in ok])
    in_flight = peak = 0
    for _, change in events:
        in_flight += change
        peak = max(peak, in_flight)
    return float(tokens.max()), peak


def compute_metrics(
    records: list[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = (99.0,),
    goodput_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    per_metric = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for t in (r.tpot for r in ok) if t is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    good = sum(_is_good(r, goodput_ms) for r in ok) if goodput_ms else None
    peak_tokens, peak_concurrency = _peaks(records)
    return BenchmarkMetrics(
        duration=duration_s,
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input=total_in,
        total_output=total_out,
        request_throughput=len(ok) / duration_s,
        request_goodput=None if good is None else good / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_concurrency,
        stats={name: Stats.of(values, percentiles) for name, values in per_metric.items()},
    )


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def metrics_dict(m: BenchmarkMetrics, selected: Sequence[str] = tuple(METRICS)) -> dict[str, Any]:
    """The summary keys `vllm bench serve --save-result` writes."""
    out: dict[str, Any] = {
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for name in selected:
        s = m.stats[name]
        out[f"mean_{name}_ms"], out[f"median_{name}_ms"], out[f"std_{name}_ms"] = s.mean, s.median, s.std
        for p, value in s.percentiles:
            out[f"p{_p_word(p)}_{name}_ms"] = value
    return out


def per_request_dict(records: list[RequestRecord]) -> dict[str, list]:
    """The per-request lists vLLM saves beside the summary."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_len if r.success else 0 for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "start_times": [r.start for r in records],
        "errors": [r.error for r in records],
    }


def prefix_reuse(requests: Sequence[Any], records: Sequence[RequestRecord]) -> dict[str, float]:
    """What reusing prefixes did for a run, where it can be told: the share of the prompt tokens
    the server's prefix cache held (if it reported them) and, for conversations, the mean TTFT of
    first turns and of later turns. `requests` are the workload's BenchRequests, in record order."""
    ok = [i for i, r in enumerate(records) if r.success]
    out: dict[str, float] = {}
    reported = [i for i in ok if records[i].cached_tokens is not None]
    prompt_tokens = sum(records[i].prompt_len for i in reported)
    if reported and prompt_tokens:
        out["cached_prompt_share"] = sum(records[i].cached_tokens or 0 for i in reported) / prompt_tokens
    later = [records[i].ttft for i in ok if requests[i].follows is not None]
    if later:
        out["ttft_mean_first_turns_ms"] = 1000 * float(np.mean([records[i].ttft for i in ok
                                                                 if requests[i].follows is None]))
        out["ttft_mean_later_turns_ms"] = 1000 * float(np.mean(later))
    return out


def format_reuse(reuse: dict[str, float]) -> str:
    names = {"cached_prompt_share": ("Cached share of prompt tokens:", "{:.3f}"),
             "ttft_mean_first_turns_ms": ("Mean TTFT, first turns (ms):", "{:.2f}"),
             "ttft_mean_later_turns_ms": ("Mean TTFT, later turns (ms):", "{:.2f}")}
    return "\n".join(f"{names[k][0]:<40}{names[k][1].format(v):>10}" for k, v in reuse.items() if k in names)


def format_result(
    m: BenchmarkMetrics,
    selected: Sequence[str] = tuple(METRICS),
    request_rate: float | None = None,
    max_concurrency: int | None = None,
) -> str:
    """The block `vllm bench serve` prints, line for line."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: object, fmt: str = "") -> None:
        lines.append("{:<40} {:<10{}}".format(label, value, fmt))

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate is not None and request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", m.duration, ".2f")
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput, ".2f")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f")
    row("Peak concurrent requests:", m.max_concurrent_requests, ".2f")
    row("Total Token throughput (tok/s):", m.total_token_throughput, ".2f")
    for name in selected:
        short, header = METRICS[name]
        s = m.stats[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", s.mean, ".2f")
        row(f"Median {short} (ms):", s.median, ".2f")
        for p, value in s.percentiles:
            row(f"P{_p_word(p)} {short} (ms):", value, ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def parse_selection(metrics: str | None, percentiles: str | None) -> tuple[list[str], list[float]]:
    """`--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99` -> lists."""
    selected = [m.strip() for m in (metrics or ",".join(METRICS)).split(",") if m.strip()]
    unknown = [m for m in selected if m not in METRICS]
    if unknown:
        raise ConfigError(f"unknown metrics {unknown}; choose from {', '.join(METRICS)}")
    try:
        chosen = [float(p) for p in (percentiles or "99").split(",") if p.strip()]
    except ValueError:
        chosen = []
    if not chosen or not all(0 <= p <= 100 for p in chosen):
        raise ConfigError(f"percentiles are numbers from 0 to 100, comma-separated (e.g. 50,90,99); got {percentiles!r}")
    return selected, chosen
