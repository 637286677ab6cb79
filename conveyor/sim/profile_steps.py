"""`conveyor simulate fit`: measure the real engine's step times over a grid of batch shapes and
fit the profiled cost model to them.

Every engine step of every episode is a sample: the step's shape (conveyor/sim/shape.py, taken
from the scheduler's decision as the runner receives it) and the wall time of the whole
`LLMEngine.step()` (scheduling, input preparation, forward, sampling, bookkeeping: what a token's
timestamp includes in the real benchmark). Episodes cover decode batches at mixed context lengths
(so rows x longest context and the plain sum of contexts can be told apart), whole prompts of
several lengths, and prompts cut into chunks that ride along with decodes.
"""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from conveyor.bench.workloads import FIRST_REGULAR_ID
from conveyor.engine.llm_engine import LLMEngine
from conveyor.runner.stats import StepStats
from conveyor.sampling.outputs import SamplerOutput
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler import SchedulerOutput
from conveyor.sim.profiled import Profile, fit_profile
from conveyor.sim.shape import StepShape


@dataclass
class Wave:
    """Requests added together once the previous wave's prompts are all computed."""

    prompt_lens: list[int]
    output_len: int


@dataclass
class Episode:
    waves: list[Wave]
    budget: int = 2048  # max_num_batched_tokens during the episode
    chunked: bool = True


@dataclass
class ProfileGrid:
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    contexts: list[int] = field(default_factory=lambda: [32, 192, 448])
    max_batch_tokens: int = 4096  # skip decode batches whose contexts sum beyond this (prefill time)
    decode_steps: int = 3
    prompt_lens: list[int] = field(default_factory=lambda: [128, 384])
    chunk_episodes: bool = True  # prompts cut into chunks beside running decodes
    repeats: int = 1

    def episodes(self) -> list[Episode]:
        eps = []
        for context in self.contexts:
            for batch in self.batch_sizes:
                # Contexts spread over [context/4, context]: the sum and rows x longest differ.
                lens = [max(1, context // 4 + (context - context // 4) * i // max(1, batch - 1)) for i in range(batch)]
                if sum(lens) <= self.max_batch_tokens:
                    eps.append(Episode([Wave(lens, self.decode_steps + 1)]))
        for n in self.prompt_lens:
            eps.append(Episode([Wave([n], 2)], budget=max(2048, n), chunked=False))
        if not self.chunk_episodes:
            return eps * self.repeats
        # Chunked prompts beside running decodes (Sarathi-style steps).
        eps.append(Episode([Wave([96] * 6, 12), Wave([384], 2)], budget=128))
        eps.append(Episode([Wave([160] * 8, 8), Wave([256], 2)], budget=128))
        eps.append(Episode([Wave([64] * 4, 10), Wave([200, 300], 2)], budget=512))
        eps.append(Episode([Wave([48, 80], 12), Wave([40, 90, 60], 4)], budget=256))  # light mixed steps
        return eps * self.repeats


class ShapeRecorder:
    """Wraps the real runner; remembers the shape of the step it last executed (of all, if `keep`)."""

    def __init__(self, inner: Any, keep: bool = False) -> None:
        self.inner = inner
        self.last_shape: StepShape | None = None
        self.shapes: list[StepShape] | None = [] if keep else None

    def execute(self, out: SchedulerOutput, stats: StepStats) -> SamplerOutput:
        self.last_shape = StepShape.of(out)
        if self.shapes is not None:
            self.shapes.append(self.last_shape)
        return self.inner.execute(out, stats)


def _prompt(n: int, salt: int, vocab: int) -> list[int]:
    return [FIRST_REGULAR_ID + (salt * 7919 + 31 * j) % (vocab - FIRST_REGULAR_ID) for j in range(n)]


def run_episode(engine: LLMEngine, episode: Episode, recorder: ShapeRecorder, salt: int = 0) -> list[tuple[StepShape, float]]:
    sched = engine.scheduler.config
    sched.max_num_batched_tokens, sched.chunked_prefill = episode.budget, episode.chunked
    samples: list[tuple[StepShape, float]] = []
    for w, wave in enumerate(episode.waves):
        params = SamplingParams(max_tokens=wave.output_len, temperature=0.0, ignore_eos=True)
        added = [engine.add_request(_prompt(n, salt + 101 * w + i, engine.vocab_size), params)
                 for i, n in enumerate(wave.prompt_lens)]
        last = w == len(episode.waves) - 1
        while engine.has_unfinished_requests:
            if not last and all(r.num_computed_tokens >= r.num_prompt_tokens
                                for r in engine.scheduler.requests.values() if r.group_id in added):
                break  # this wave is decoding: the next one joins it
            t0 = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t0
            if engine.last_step.num_requests and recorder.last_shape is not None:
                samples.append((recorder.last_shape, seconds))
    return samples


def measure(engine: LLMEngine, grid: ProfileGrid,
            echo: Callable[[str], None] | None = print) -> list[tuple[StepShape, float]]:
    recorder = ShapeRecorder(engine.runner)
    engine.runner = recorder
    # The grid's prompts repeat: each must be computed whole for the step shapes to be the planned ones.
    engine.scheduler.set_prefix_caching(False)
    run_episode(engine, Episode([Wave([32, 48], 4)]), recorder)  # warm-up, not recorded
    samples: list[tuple[StepShape, float]] = []
    episodes = grid.episodes()
    for i, episode in enumerate(episodes):
        samples += run_episode(engine, episode, recorder, salt=i)
        if echo and (i + 1) % 5 == 0:
            echo(f"  {i + 1}/{len(episodes)} episodes, {len(samples)} steps measured")
    engine.runner = recorder.inner
    return samples


def profile_engine(engine_kwargs: dict[str, Any], grid: ProfileGrid | None = None,
                   echo: Callable[[str], None] = print, loaded: Any | None = None) -> Profile:
    """Measures the grid on the real engine and fits. `engine_kwargs` go to EngineConfig.from_kwargs;
    `loaded` (runner.model_runner.LoadedModel) reuses weights already in memory."""
    from conveyor.config import EngineConfig

    grid = grid or ProfileGrid()
    kwargs = {"max_num_seqs": max([64, *grid.batch_sizes]), **engine_kwargs}
    config = EngineConfig.from_kwargs(**kwargs)
    engine = LLMEngine.from_config(config, loaded)
    t0 = time.perf_counter()
    samples = measure(engine, grid, echo)
    meta = {"model": config.model or "smollm2-135m", "dtype": config.dtype, "num_threads": config.num_threads,
            "block_size": config.block_size, "machine": platform.node(), "processor": platform.processor(),
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "measure_seconds": round(time.perf_counter() - t0, 1), "grid": grid.__dict__}
    return fit_profile([s for s, _ in samples], [t for _, t in samples], meta)
