"""`bench serve` against a tiny SSE server started in the test (plain asyncio HTTP, no model)."""
from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import pytest

from conveyor.bench.metrics import compute_metrics, prefix_reuse
from conveyor.bench.serve_client import ServeConfig, result_dict, run_benchmark
from conveyor.bench.workloads import BenchRequest, WorkloadConfig

FIRST_S, GAP_S = 0.05, 0.02


class FakeOpenAIServer:
    """Streams `max_tokens` completion chunks FIRST_S, then GAP_S apart; prompts of token id 13 fail.

    `written[prompt[0]]` holds when each token chunk was written (time.perf_counter)."""

    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []
        self.written: dict[int, list[float]] = {}
        self.in_flight = self.max_in_flight = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        request_line, *header_lines = head.split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        if request_line.startswith("GET /v1/models"):
            data = b'{"object": "list", "data": [{"id": "fake"}]}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (len(data), data))
        else:
            await self.complete(json.loads(body), writer)
        await writer.drain()
        writer.close()

    async def complete(self, payload: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        self.payloads.append(payload)
        if payload["prompt"][0] == 13:
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\nConnection: close\r\n\r\nboom")
            return
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        n = payload["max_tokens"]
        written = self.written.setdefault(payload["prompt"][0], [])

        def event(obj: Any) -> bytes:
            return f"data: {json.dumps(obj)}\n\n".encode()

        await asyncio.sleep(FIRST_S)
        for i in range(n):
            if i:
                await asyncio.sleep(GAP_S)
            writer.write(b": keep-alive comment\n\n" if i == 1 else b"")
            choice = {"index": 0, "text": f"t{i}", "finish_reason": None}
            message: dict[str, Any] = {"choices": [choice], "usage": None}
            if payload.get("return_token_ids"):
                choice["token_ids"] = [500 + i]
            elif payload.get("return_tokens") and payload.get("verbose"):  # llama.cpp's server's way
                message["__verbose"] = {"tokens": [500 + i]}
            writer.write(event(message))
            written.append(time.perf_counter())
            await writer.drain()
        writer.write(event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": None}))
        usage = {"prompt_tokens": len(payload["prompt"]), "completion_tokens": n, "total_tokens": n}
        if len(payload["prompt"]) > 2:  # a later turn: its history "was cached"
            usage["prompt_tokens_details"] = {"cached_tokens": len(payload["prompt"]) - 1}
        writer.write(event({"choices": [], "usage": usage}))
        writer.write(b"data: [DONE]\n\n")
        self.in_flight -= 1


def _run(cfg: ServeConfig, requests: list[BenchRequest]) -> tuple[FakeOpenAIServer, list, float]:
    async def scenario() -> tuple[FakeOpenAIServer, list, float]:
        fake = FakeOpenAIServer()
        cfg.base_url = await fake.start()
        records, duration = await run_benchmark(cfg, requests)
        fake.server.close()  # type: ignore[union-attr]
        return fake, records, duration

    return asyncio.run(scenario())


def test_streams_are_timed_per_chunk_and_payloads_are_vllm_shaped(monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.bench import serve_client

    received: dict[int, list[float]] = {}  # when the client stamped each token chunk, on the server's clock
    send_request = serve_client.send_request

    async def recording_send_request(client: Any, cfg: ServeConfig, req: BenchRequest, *args: Any) -> Any:
        record = await send_request(client, cfg, req, *args)
        stamps = [record.start + record.ttft]  # record.start is still absolute here
        for gap in record.itl:
            stamps.append(stamps[-1] + gap)
        received[req.prompt_token_ids[0]] = stamps
        return record

    monkeypatch.setattr(serve_client, "send_request", recording_send_request)
    requests = [BenchRequest([20 + i, 30, 40], 4 + i) for i in range(3)]
    cfg = ServeConfig(model="fake", disable_tqdm=True, api_key="k")
    fake, records, duration = _run(cfg, requests)
    for req, payload in zip(requests, sorted(fake.payloads, key=lambda p: p["prompt"][0])):
        assert payload["prompt"] == req.prompt_token_ids and payload["max_tokens"] == req.output_len
        assert payload["ignore_eos"] is True and payload["stream"] is True and payload["temperature"] == 0.0
        assert payload["stream_options"] == {"include_usage": True} and payload["model"] == "fake"
    for req, r in zip(requests, records):
        assert r.success and r.prompt_len == 3 and r.output_len == req.output_len
        assert len(r.itl) == req.output_len - 1  # the finish-only chunk is not a token
        assert r.latency == pytest.approx(r.ttft + sum(r.itl))
        assert r.tpot == pytest.approx(sum(r.itl) / len(r.itl))
        assert r.ttft >= FIRST_S - 0.005  # the server waits that long before its first token
        # Each stamp is taken after its chunk was written, and the first one well before the stream's
        # last token: bounds by the server's own clock, which a loaded machine cannot break (an
        # absolute bound on TTFT failed on a busy 2-core CI box, the first connection took 0.5 s).
        written, stamps = fake.written[req.prompt_token_ids[0]], received[req.prompt_token_ids[0]]
        assert all(seen >= sent for seen, sent in zip(stamps, written, strict=True))
        assert stamps[0] < written[-1]
    assert duration >= max(r.latency for r in records)


def test_failures_concurrency_cap_and_saved_json() -> None:
    requests = [BenchRequest([20, 1], 3), BenchRequest([13, 1], 3)] + [BenchRequest([21 + i], 2) for i in range(4)]
    cfg = ServeConfig(model="fake", disable_tqdm=True, max_concurrency=2, request_rate=200.0,
                      goodput={"ttft": 10_000}, workload=WorkloadConfig(seed=1))
    fake, records, duration = _run(cfg, requests)
    assert fake.max_in_flight <= 2
    assert [r.success for r in records] == [True, False, True, True, True, True]
    assert "HTTP 500" in records[1].error
    metrics = compute_metrics(records, duration, goodput_ms=cfg.goodput)
    assert metrics.completed == 5 and metrics.failed == 1 and metrics.total_output == 3 + 4 * 2
    assert metrics.request_goodput == pytest.approx(5 / duration)
    saved = json.loads(json.dumps(result_dict(cfg, records, metrics, {})))
    assert saved["completed"] == 5 and saved["output_lens"] == [3, 0, 2, 2, 2, 2]
    assert saved["request_rate"] == 200.0 and saved["max_concurrency"] == 2
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "itls"):
        assert key in saved
    assert math.isfinite(saved["mean_e2el_ms"])


def test_a_role_announcement_is_not_the_first_token():
    from conveyor.bench.serve_client import _is_token_chunk

    # A chat server that announces the role at acceptance: that chunk must not start the TTFT clock.
    assert not _is_token_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
    assert not _is_token_chunk({"index": 0, "delta": {"role": "assistant"}, "finish_reason": None})
    assert _is_token_chunk({"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None})
    assert _is_token_chunk({"index": 0, "delta": {"content": ""}, "finish_reason": None})  # a held-back token
    assert _is_token_chunk({"index": 0, "text": "", "finish_reason": None})
    assert not _is_token_chunk({"index": 0, "text": "", "finish_reason": "length"})  # only the finish
    assert _is_token_chunk({"index": 0, "text": "end", "finish_reason": "stop"})


def test_multi_turn_sends_the_next_turn_with_the_history_after_the_think_time() -> None:
    requests = [BenchRequest([20, 21], 3), BenchRequest([30], 2), BenchRequest([22], 2, follows=0, think_time=0.1),
                BenchRequest([23, 24], 2, follows=2, think_time=0.0)]
    cfg = ServeConfig(model="fake", workload=WorkloadConfig(), disable_tqdm=True, ready_timeout_s=0)
    fake, records, _ = _run(cfg, requests)
    by_prompt = {tuple(p["prompt"]): p for p in fake.payloads}
    turn2 = (20, 21, 500, 501, 502, 22)
    assert turn2 in by_prompt and by_prompt[turn2].get("return_token_ids")
    assert turn2 + (500, 501, 23, 24) in by_prompt
    assert [r.prompt_len for r in records] == [2, 1, 6, 10]
    assert all(r.success for r in records)
    assert records[2].start >= records[0].start + records[0].latency + 0.1 - 1e-3


def test_a_peer_that_returns_token_ids_its_own_way_gets_the_same_history_and_cache_figures() -> None:
    """llama.cpp's server gives generated ids as `__verbose.tokens` (asked with --extra-body), and
    its usage reports cached prompt tokens: the later turns and the reuse summary come out the same."""
    requests = [BenchRequest([20, 21], 3), BenchRequest([22], 2, follows=0, think_time=0.0)]
    cfg = ServeConfig(model="fake", workload=WorkloadConfig(), disable_tqdm=True, ready_timeout_s=0,
                      extra_body={"return_tokens": True, "verbose": True})
    fake, records, _ = _run(cfg, requests)
    assert fake.payloads[1]["prompt"] == [20, 21, 500, 501, 502, 22]
    assert fake.payloads[1]["return_tokens"] is True
    assert [r.cached_tokens for r in records] == [None, 5]
    reuse = prefix_reuse(requests, records)
    assert reuse["cached_prompt_share"] == 5 / 6  # over the requests whose usage said
    assert reuse["ttft_mean_later_turns_ms"] == 1000 * records[1].ttft
