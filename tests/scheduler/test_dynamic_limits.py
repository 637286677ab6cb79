"""Limits set at run time (what the SLO controller does): a lowered cap holds admissions back and
preempts nobody; a lowered budget bounds every step; neither can stall a request."""
from __future__ import annotations

import itertools

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.sampling.params import SamplingParams
from tests.fakes import FakeRunner


def engine(policy: str = "continuous", max_num_seqs: int = 8, budget: int = 64, chunked: bool = True) -> LLMEngine:
    ticks = itertools.count()
    config = EngineConfig.from_kwargs(policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      chunked_prefill=chunked, block_size=4)
    return LLMEngine(config, FakeRunner(), num_kv_blocks=256, max_model_len=256, vocab_size=1000,
                     clock=lambda: float(next(ticks)))


def add(e: LLMEngine, n: int, prompt_len: int = 4, max_tokens: int = 6, samples: int = 1) -> None:
    for i in range(n):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=samples, temperature=1.0 if samples > 1 else 0.0)
        e.add_request([11 + i] * prompt_len, params)


def test_lowering_the_cap_below_the_batch_preempts_nobody_and_admits_nobody_until_it_shrinks():
    e = engine(max_num_seqs=8)
    add(e, 12, max_tokens=20)
    e.step()
    assert e.scheduler.num_running == 8
    e.scheduler.set_limits(3, None)
    assert e.scheduler.max_num_seqs == 3
    running, finished = [], 0
    while e.has_unfinished_requests:
        finished += sum(o.finished for o in e.step())
        assert e.last_step.num_preempted == 0
        running.append(e.scheduler.num_running)
    assert e.scheduler.num_preemptions == 0 and finished == 12
    # The first 8 keep running to their end (nobody is pushed out); after that, 3 at most at once.
    drained = next(i for i, n in enumerate(running) if n < 8)
    assert drained >= 15 and all(n == 8 for n in running[:drained])
    assert all(n <= 3 for n in running[drained:]) and max(running[drained:]) == 3


def test_a_cap_above_the_configured_one_is_ignored():
    e = engine(max_num_seqs=4)
    e.scheduler.set_limits(100, 10_000)
    assert (e.scheduler.max_num_seqs, e.scheduler.max_num_batched_tokens) == (4, 64)
    e.scheduler.set_limits(0, 0)
    assert (e.scheduler.max_num_seqs, e.scheduler.max_num_batched_tokens) == (1, 1)
    e.scheduler.set_limits(None, None)
    assert (e.scheduler.max_num_seqs, e.scheduler.max_num_batched_tokens) == (4, 64)


def test_a_lowered_budget_bounds_every_step():
    e = engine(max_num_seqs=8, budget=64)
    add(e, 6, prompt_len=30)
    e.scheduler.set_limits(None, 20)
    runner = e.runner
    while e.has_unfinished_requests:
        e.step()
    assert max(out.num_tokens for out in runner.steps) <= 20
    assert e.scheduler.num_preemptions == 0


def test_without_chunked_prefill_the_budget_is_not_lowered():
    e = engine(budget=64, chunked=False)
    e.scheduler.set_limits(None, 8)  # would never fit a 30-token prompt: it must not apply
    assert e.scheduler.max_num_batched_tokens == 64
    add(e, 2, prompt_len=30)
    while e.has_unfinished_requests:
        e.step()


def test_an_empty_batch_takes_a_request_whose_samples_exceed_the_cap():
    for policy in ("continuous", "static"):
        e = engine(policy, max_num_seqs=8)
        e.scheduler.set_limits(1, None)
        add(e, 2, samples=3)
        steps = 0
        while e.has_unfinished_requests:
            e.step()
            steps += 1
            assert steps < 100, f"{policy} stalled"


def test_static_forms_batches_under_the_lowered_cap():
    e = engine("static", max_num_seqs=8)
    e.scheduler.set_limits(2, None)
    add(e, 5)
    sizes = []
    while e.has_unfinished_requests:
        e.step()
        sizes.append(e.scheduler.batch_size)
    assert max(sizes) == 2
