"""Metric definitions on hand-made timestamps: the numbers `vllm bench serve` would report."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conveyor.bench.metrics import (
    RequestRecord, compute_metrics, format_result, metrics_dict, parse_goodput, parse_selection,
)


def _records() -> list[RequestRecord]:
    # A: sent at 0, tokens at 0.5, 0.6, 0.8, 1.1 -> TTFT 0.5, ITL [0.1, 0.2, 0.3], E2E 1.1, TPOT 0.2
    a = RequestRecord(prompt_len=10, output_len=4, start=0.0, ttft=0.5, itl=[0.1, 0.2, 0.3], latency=1.1)
    # B: sent at 1.0, one token at 1.2 -> TTFT 0.2, no ITL, no TPOT
    b = RequestRecord(prompt_len=20, output_len=1, start=1.0, ttft=0.2, itl=[], latency=0.2)
    # C: sent at 0.5, tokens at 1.5, 1.6 -> TTFT 1.0, ITL [0.1], E2E 1.1, TPOT 0.1
    c = RequestRecord(prompt_len=30, output_len=2, start=0.5, ttft=1.0, itl=[0.1], latency=1.1)
    failed = RequestRecord(prompt_len=99, success=False, error="boom")
    return [a, b, c, failed]


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    a, b, c, failed = _records()
    assert a.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert b.tpot is None  # one token: no TPOT
    assert c.tpot == pytest.approx(0.1)
    assert failed.tpot is None
    assert a.token_times() == pytest.approx([0.5, 0.6, 0.8, 1.1])


def test_aggregates_match_vllm_definitions() -> None:
    m = compute_metrics(_records(), duration_s=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (60, 7)  # failed requests count for neither
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(33.5)
    ttft = m.stats["ttft"]
    assert ttft.mean == pytest.approx(1000 * (0.5 + 0.2 + 1.0) / 3)
    assert ttft.median == pytest.approx(500)
    assert dict(ttft.percentiles)[99] == pytest.approx(1000 * np.percentile([0.5, 0.2, 1.0], 99))
    tpot = m.stats["tpot"]  # only requests with > 1 token
    assert tpot.mean == pytest.approx(1000 * (0.2 + 0.1) / 2)
    itl = m.stats["itl"]  # over all gaps, not per request
    assert itl.mean == pytest.approx(1000 * np.mean([0.1, 0.2, 0.3, 0.1]))
    assert dict(itl.percentiles)[50] == pytest.approx(150)
    assert m.stats["e2el"].mean == pytest.approx(1000 * (1.1 + 0.2 + 1.1) / 3)
    assert m.request_goodput is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = _records()
    # ttft <= 600 ms: A (500) and B (200); tpot <= 150 ms: B (one token counts as 0) and C (100).
    assert compute_metrics(records, 2.0, goodput_ms={"ttft": 600}).request_goodput == pytest.approx(1.0)
    assert compute_metrics(records, 2.0, goodput_ms={"tpot": 150}).request_goodput == pytest.approx(1.0)
    both = compute_metrics(records, 2.0, goodput_ms={"ttft": 600, "tpot": 150})
    assert both.request_goodput == pytest.approx(0.5)  # only B
    # SLOs are inclusive (values chosen exact in binary floating point)
    exact = [RequestRecord(prompt_len=1, output_len=3, start=0.0, ttft=0.5, itl=[0.25, 0.25], latency=1.0)]
    assert compute_metrics(exact, 1.0, goodput_ms={"ttft": 500, "tpot": 250, "e2el": 1000}).request_goodput == 1.0
    assert compute_metrics(exact, 1.0, goodput_ms={"tpot": 249}).request_goodput == 0.0
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["ttft=5"], ["itl:5"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_peaks_bucket_tokens_and_requests_per_second() -> None:
    m = compute_metrics(_records(), 2.0)
    # tokens at 0.5, 0.6, 0.8 (second 0) and 1.1, 1.2, 1.5, 1.6 (second 1)
    assert m.max_output_tokens_per_s == 4
    assert m.max_concurrent_requests == 3  # all three in flight from 1.0 to 1.1


def test_requests_one_after_another_are_never_concurrent() -> None:
    # As with --max-concurrency 1: each request starts when the one before ends (or just after),
    # several of them within one second.
    one_by_one = [RequestRecord(prompt_len=1, output_len=1, start=0.25 * i, ttft=0.25, latency=0.25) for i in range(8)]
    assert compute_metrics(one_by_one, 2.0).max_concurrent_requests == 1
    overlapping = one_by_one + [RequestRecord(prompt_len=1, output_len=1, start=0.3, ttft=0.1, latency=0.1)]
    assert compute_metrics(overlapping, 2.0).max_concurrent_requests == 2


def test_printed_block_and_json_keys_follow_vllm() -> None:
    m = compute_metrics(_records(), 2.0, percentiles=[99], goodput_ms={"ttft": 600})
    text = format_result(m, request_rate=4.0, max_concurrency=8)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "Successful requests:                     3         " in lines
    assert "Benchmark duration (s):                  2.00      " in lines
    assert "Request goodput (req/s):                 1.00      " in lines
    assert "Output token throughput (tok/s):         3.50      " in lines
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "---------------Inter-token Latency----------------" in lines
    assert "----------------End-to-end Latency----------------" in lines
    assert "Mean TTFT (ms):                          566.67    " in lines
    assert "Median TPOT (ms):                        150.00    " in lines
    for label in ("Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
                  "Total Token throughput (tok/s):", "P99 TTFT (ms):", "P99 ITL (ms):", "P99 E2EL (ms):"):
        assert any(line.startswith(label) for line in lines), label
    d = metrics_dict(m)
    json.dumps(d)
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "std_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "completed", "total_output_tokens"):
        assert key in d, key
    assert parse_selection("ttft,itl", "50,99.9") == (["ttft", "itl"], [50.0, 99.9])
    assert "p99.9_ttft_ms" in metrics_dict(compute_metrics(_records(), 2.0, [99.9]), ["ttft"])


def test_no_successful_request_gives_zeros_not_errors() -> None:
    m = compute_metrics([RequestRecord(prompt_len=5, success=False)], 1.0)
    assert m.completed == 0 and m.stats["ttft"].mean == 0.0 and m.max_concurrent_requests == 0
