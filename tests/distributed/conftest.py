"""Shared pieces of the Ray tests: a tiny random-weight model, its single-engine reference outputs,
a local Ray instance per test module, and a driver that runs requests through a deployment."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from conveyor.config import EngineConfig
from conveyor.engine.async_engine import Aborted, Failed
from conveyor.engine.llm_engine import LLMEngine
from conveyor.sampling.params import SamplingParams
from tests.helpers import make_tiny_hf_checkpoint

RUN_TIMEOUT_S = 60.0  # a request that has not ended by then counts as hung


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ray-tiny"))


def tiny_config(model: Path, **overrides: object) -> EngineConfig:
    # A small step budget so that longer prompts are prefilled in chunks; one torch thread per engine.
    kwargs: dict = dict(model=str(model), num_kv_blocks=64, max_num_batched_tokens=32, num_threads=1)
    kwargs.update(overrides)
    return EngineConfig.from_kwargs(**kwargs)


def make_prompts(count: int, shortest: int = 5, step: int = 11) -> list[list[int]]:
    return [[(37 * i + 11 * j) % 2000 + 10 for j in range(shortest + step * i % 90)] for i in range(count)]


def reference_outputs(config: EngineConfig, prompts: Sequence[list[int]],
                      params: Sequence[SamplingParams]) -> dict[str, list[list[int]]]:
    """Every sample's tokens from one in-process engine, all requests submitted at once."""
    engine = LLMEngine.from_config(config)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, f"r{i}")
    outputs: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                outputs.setdefault(out.request_id, [[] for _ in range(params[int(out.request_id[1:])].n)])
                outputs[out.request_id][out.index] = list(out.token_ids)
    return outputs


@contextlib.contextmanager
def local_ray(num_cpus: int = 4) -> Iterator[None]:
    import ray

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@dataclass
class Outcome:
    """How one request ended: its samples' tokens (as streamed), or the error/abort that ended it."""

    tokens: list[list[int]] = field(default_factory=list)
    streamed: list[list[int]] = field(default_factory=list)  # new_token_ids event by event
    error: BaseException | None = None
    aborted: bool = False
    cached_tokens: int = 0  # prompt tokens the worker's prefix cache held
    prompt_logprobs: list | None = None  # with SamplingParams.prompt_logprobs: as the first event brought them


async def collect(sink: asyncio.Queue, n: int) -> Outcome:
    outcome = Outcome([[] for _ in range(n)], [])
    left = n
    while left:
        event = await asyncio.wait_for(sink.get(), RUN_TIMEOUT_S)
        if isinstance(event, Failed):
            outcome.error = event.error
            return outcome
        if isinstance(event, Aborted):
            outcome.aborted = True
            return outcome
        outcome.streamed.append(list(event.new_token_ids))
        outcome.cached_tokens = event.num_cached_tokens
        if outcome.prompt_logprobs is None:
            outcome.prompt_logprobs = event.prompt_logprobs
        outcome.tokens[event.index] = list(event.token_ids)
        left -= event.finished
    return outcome


async def run_requests(client, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
                       prefix: str = "r") -> dict[str, Outcome]:
    sinks = {f"{prefix}{i}": asyncio.Queue() for i in range(len(prompts))}
    await asyncio.gather(*(client.add_request(rid, prompt, p, sinks[rid])
                           for (rid, prompt, p) in zip(sinks, prompts, params)))
    results = await asyncio.gather(*(collect(sinks[rid], p.n) for rid, p in zip(sinks, params)))
    return dict(zip(sinks, results))
