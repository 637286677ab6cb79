"""Prefill, then time decode steps: the one helper behind every decode-step measurement
(`conveyor bench roofline`, `conveyor bench steps`, benchmarks/slo_controller.py).

`start_decode_batch` adds `batch` requests and steps until every prompt is computed, so each
following step is a pure decode step of the whole batch; `time_decode_steps` then times steps on
the engine's own clock (wall time on the real engine, virtual time on the simulator's) and
aborts the requests, leaving the engine as it found it. Torch-free: the simulator uses it too.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Sequence

from conveyor.engine.llm_engine import LLMEngine
from conveyor.sampling.params import SamplingParams


def decode_prompt(i: int, length: int) -> list[int]:
    """Request i's prompt: distinct per request, regular token ids of any vocabulary over 30,100."""
    return [100 + (7 * i + 13 * j) % 30000 for j in range(length)]


def start_decode_batch(engine: LLMEngine, batch: int, contexts: Sequence[int], steps: int,
                       seed: int = 0, shared_prefix: tuple[int, int] | None = None,
                       temperature: float = 0.0) -> list[str]:
    """Adds `batch` requests with prompt lengths drawn from `contexts` and runs their prompts; the
    requests then decode for at least `steps` more steps (also when the prompts took several
    steps, during which the first ones already decoded). Returns their ids. `shared_prefix`
    (groups, tokens): request i's prompt starts with group i % groups's `tokens` tokens, followed
    by a length drawn from `contexts` of its own (prefix-cache hits, as the `prefix` workload's).
    The requests are greedy, or sample at `temperature` (seeded) where it is above 0."""
    rng = random.Random(seed)
    groups, prefix_len = shared_prefix or (1, 0)
    prompts = [decode_prompt(10_000 + i % groups, prefix_len) + decode_prompt(i, rng.choice(list(contexts)))
               for i in range(batch)]
    prefill_steps = math.ceil(sum(map(len, prompts)) / engine.config.scheduler.max_num_batched_tokens) + batch
    max_tokens = steps + prefill_steps + 8
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                                                     seed=seed + i if temperature > 0 else None))
           for i, prompt in enumerate(prompts)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    return ids


@dataclass
class DecodeSteps:
    step_s: list[float]  # each timed step, on the engine's clock
    model_s: list[float]  # of which inside the runner's forward pass

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


def time_decode_steps(engine: LLMEngine, batch: int, contexts: Sequence[int], steps: int,
                      seed: int = 0) -> DecodeSteps:
    """`steps` decode steps of `batch` requests at prompt lengths drawn from `contexts`, each timed."""
    ids = start_decode_batch(engine, batch, contexts, steps, seed)
    timed = DecodeSteps([], [])
    try:
        for _ in range(steps):
            t0 = engine.clock()
            engine.step()
            timed.step_s.append(engine.clock() - t0)
            timed.model_s.append(engine.last_step.model_s)
            if engine.last_step.num_requests != batch:
                raise RuntimeError(f"a timed step ran {engine.last_step.num_requests} of {batch} requests "
                                   "(preempted? raise the KV cache or lower the batch)")
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
    return timed
