"""`conveyor bench serve`: an async load client for any OpenAI-compatible server (ours, vLLM, llama.cpp).

Each request is POST /v1/completions with `prompt` as a list of token ids (so exactly the same
requests reach every server), `max_tokens` = the drawn output length, `ignore_eos: true`,
`temperature: 0`, `stream: true` and `stream_options.include_usage`. It records, as `vllm bench
serve` does: TTFT at the first chunk carrying a token (a choice with text, or without a
finish_reason: a token whose text is still held back; never a chat chunk that only announces
the assistant's role, which some servers send before any token), each later chunk's gap (ITL), and E2EL at
the last chunk; the output length comes from the usage chunk, else from the chunks counted.
Arrivals: all at once or gamma/Poisson at a rate (workloads.arrival_times); optional cap on
requests in flight. Prints vLLM's result block and can save vLLM's JSON keys.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from conveyor.config import client_api_key
from conveyor.errors import ConfigError
from conveyor.bench.metrics import (
    METRICS, BenchmarkMetrics, RequestRecord, compute_metrics, format_result, format_reuse, metrics_dict,
    per_request_dict, prefix_reuse,
)
from conveyor.bench.workloads import (
    BenchRequest, WorkloadConfig, describe, followers, generate_requests, next_turn_prompt, parse_rate_schedule,
    request_arrivals,
)


@dataclass
class ServeConfig:
    model: str
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    rate_schedule: str | None = None  # e.g. "0:1,120:4,240:1": piecewise rates, overrides request_rate
    max_concurrency: int | None = None
    goodput: dict[str, float] = field(default_factory=dict)
    selected_metrics: list[str] = field(default_factory=lambda: list(METRICS))
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    api_key: str | None = field(default_factory=client_api_key)
    save_result: str | None = None
    disable_tqdm: bool = False
    ready_timeout_s: float = 60.0  # wait this long for GET /v1/models to answer; 0 skips the check
    request_timeout_s: float = 6 * 3600.0
    label: str = "conveyor-bench"
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be at least 1 (leave it out for no limit), got {self.max_concurrency}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url must be an http:// or https:// URL, got {self.base_url!r}")
        if not self.ready_timeout_s >= 0:
            raise ConfigError(f"ready_timeout must be >= 0 seconds, got {self.ready_timeout_s}")


def _payload(cfg: ServeConfig, req: BenchRequest, prompt: list[int] | None = None,
             return_token_ids: bool = False) -> dict[str, Any]:
    extra = {"return_token_ids": True} if return_token_ids else {}
    return {
        **extra,
        "model": cfg.model,
        "prompt": req.prompt_token_ids if prompt is None else prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **cfg.extra_body,
    }


def _token_ids(message: dict[str, Any], choice: dict[str, Any]) -> list[int]:
    """A chunk's generated token ids: vLLM's and conveyor's `token_ids` (return_token_ids), or
    llama.cpp's server's `__verbose.tokens` (with its request fields return_tokens and verbose)."""
    ids = choice.get("token_ids")
    if ids is None:
        ids = (message.get("__verbose") or {}).get("tokens")
    return list(ids or [])


def _is_token_chunk(choice: dict[str, Any]) -> bool:
    """A chunk carries a token unless it only announces the finish (empty text + finish_reason) or,
    in chat, only the role (empty content): a server that sends that at acceptance would otherwise
    have its queueing time taken for the time to first token."""
    delta = choice.get("delta") or {}
    if choice.get("text") or delta.get("content"):
        return True
    return choice.get("finish_reason") is None and "role" not in delta


async def send_request(client: httpx.AsyncClient, cfg: ServeConfig, req: BenchRequest,
                       prompt: list[int] | None = None, output_ids: list[int] | None = None) -> RequestRecord:
    """`prompt` overrides the request's (a later turn's whole history); with `output_ids` the server is
    asked for the generated token ids (vLLM's return_token_ids), collected there."""
    record = RequestRecord(prompt_len=req.prompt_len if prompt is None else len(prompt), success=False)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    start = time.perf_counter()
    record.start = start
    last, chunks, usage_tokens = start, 0, None
    try:
        payload = _payload(cfg, req, prompt, output_ids is not None)
        async with client.stream("POST", cfg.base_url.rstrip("/") + cfg.endpoint, json=payload,
                                 headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:300]}"
                return record
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (": ping"), event names
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                message = json.loads(data)
                if "error" in message:
                    record.error = json.dumps(message["error"])[:300]
                    return record
                choices = message.get("choices")
                if choices and output_ids is not None:
                    output_ids.extend(_token_ids(message, choices[0]))
                if choices and _is_token_chunk(choices[0]):
                    now = time.perf_counter()
                    if chunks == 0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last, chunks = now, chunks + 1
                elif message.get("usage"):
                    usage_tokens = message["usage"].get("completion_tokens")
                    details = message["usage"].get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        record.cached_tokens = details["cached_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    if chunks == 0:
        record.error = "never received a chunk with a token"
        return record
    record.success = True
    record.latency = last - start
    record.output_len = usage_tokens or chunks
    return record


async def wait_until_ready(client: httpx.AsyncClient, cfg: ServeConfig) -> None:
    if cfg.ready_timeout_s <= 0:
        return
    deadline = time.monotonic() + cfg.ready_timeout_s
    url = cfg.base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    while True:
        try:
            if (await client.get(url, headers=headers, timeout=5.0)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {cfg.ready_timeout_s:.0f} s")
        await asyncio.sleep(0.5)


async def run_benchmark(cfg: ServeConfig, requests: list[BenchRequest]) -> tuple[list[RequestRecord], float]:
    """Sends every request on its schedule; returns the records (in workload order) and the duration."""
    schedule = parse_rate_schedule(cfg.rate_schedule) if cfg.rate_schedule else None
    arrivals = request_arrivals(requests, cfg.request_rate, cfg.burstiness, cfg.workload.seed, schedule)
    released_by = followers(requests)
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()
    bar = None
    if not cfg.disable_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="req")

    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s), limits=limits) as client:
        await wait_until_ready(client, cfg)

        records: list[RequestRecord | None] = [None] * len(requests)
        later: list[asyncio.Task] = []

        async def one(i: int, prompt: list[int]) -> None:
            """Send request i, then release the later turns of its conversation (multi-turn)."""
            output: list[int] | None = [] if released_by.get(i) else None
            async with semaphore:
                records[i] = await send_request(client, cfg, requests[i], prompt, output)
            if bar is not None:
                bar.update(1)
            for k in released_by.get(i, []):
                later.append(asyncio.create_task(turn(k, next_turn_prompt(prompt, output or [], requests[k]))))

        async def turn(k: int, prompt: list[int]) -> None:
            await asyncio.sleep(requests[k].think_time)
            await one(k, prompt)

        start = time.perf_counter()
        tasks = []
        for i, (req, at) in enumerate(zip(requests, arrivals)):
            if req.follows is not None:
                continue
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, req.prompt_token_ids)))
        await asyncio.gather(*tasks)
        while later:  # later turns release further turns as they finish
            await later.pop(0)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    done = [r for r in records if r is not None]
    for r in done:  # starts relative to the run's start, as the offline driver records them
        r.start -= start
    return done, duration


def result_dict(cfg: ServeConfig, records: list[RequestRecord], metrics: BenchmarkMetrics,
                reuse: dict[str, float]) -> dict[str, Any]:
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "label": cfg.label,
        "base_url": cfg.base_url,
        "model_id": cfg.model,
        "dataset": cfg.workload.dataset,
        "num_prompts": len(records),
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "rate_schedule": cfg.rate_schedule,
        "max_concurrency": cfg.max_concurrency,
        "goodput": cfg.goodput or None,
        **metrics_dict(metrics, cfg.selected_metrics),
        **reuse,
        **per_request_dict(records),
    }


def main(cfg: ServeConfig) -> int:
    requests = generate_requests(cfg.workload)
    print(f"workload {cfg.workload.dataset}: {describe(requests)}")
    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    process = "Poisson process" if cfg.burstiness == 1.0 else "Gamma distribution"
    if cfg.rate_schedule:
        rate = f"schedule {cfg.rate_schedule} (start s:req/s)"
    print(f"Traffic request rate: {rate}\nBurstiness factor: {cfg.burstiness} ({process})\n"
          f"Maximum request concurrency: {cfg.max_concurrency}")
    records, duration = asyncio.run(run_benchmark(cfg, requests))
    metrics = compute_metrics(records, duration, cfg.percentiles, cfg.goodput or None)
    failed = [r for r in records if not r.success]
    if failed:
        print(f"===== failed outputs[0] = {failed[0].error} =====")
    print(format_result(metrics, cfg.selected_metrics, cfg.request_rate, cfg.max_concurrency))
    reuse = prefix_reuse(requests, records)
    if reuse:
        print(format_reuse(reuse))
    if cfg.save_result:
        path = Path(cfg.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result_dict(cfg, records, metrics, reuse), indent=1))
        print(f"saved {path}")
    return 0 if metrics.completed else 1
