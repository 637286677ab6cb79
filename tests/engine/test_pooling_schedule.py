"""Embedding requests under random scheduling: every position an embedding pools reaches it exactly
once, whether its prompt is chunked, preempted and recomputed, started from cached prefix blocks, or
batched with requests that generate; and it frees its KV blocks.

The runner is the real one's input builder (runner/inputs.py) over a model that computes nothing:
a pooled row's "hidden state" is (its position, its token, its position squared), so the engine's
mean of them is exact and any row pooled twice or skipped shows.
"""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.runner.inputs import build_inputs
from conveyor.sampling import PoolingParams, SamplingParams
from conveyor.sampling.outputs import SamplerOutput
from tests.fakes import FakeRunner, fake_engine


class PoolingRunner(FakeRunner):
    supports_pooling = True

    def __init__(self) -> None:
        super().__init__()
        self.pooled_steps = 0

    def execute(self, out, stats):  # noqa: ANN001, ANN201 - Runner protocol
        sampled = super().execute(out, stats)
        inputs = build_inputs(out, self.block_size)
        first = len(inputs.logits_indices) - inputs.num_pooled_rows
        rows = inputs.logits_indices[first:]
        positions, tokens = inputs.positions[rows].tolist(), inputs.input_ids[rows].tolist()
        pooled, at = {}, 0
        for request, count in inputs.pooled_rows:
            pos, tok = positions[at: at + count], tokens[at: at + count]
            assert all(p < request.num_prompt_tokens for p in pos), "a pooled row past the prompt"
            assert tok == [request.prompt_token_ids[p] for p in pos]
            pooled[request.request_id] = ([float(sum(pos)), float(sum(tok)), float(sum(p * p for p in pos))], count)
            at += count
        self.pooled_steps += bool(pooled)
        return SamplerOutput(sampled.tokens, pooled=pooled or None)


def expected(prompt: list[int], pooling_type: str) -> list[float]:
    positions = PoolingParams(pooling_type).positions(len(prompt))
    n = len(positions)
    return [sum(positions) / n, sum(prompt[p] for p in positions) / n, sum(p * p for p in positions) / n]


@dataclass
class Item:
    prompt: list[int]
    pooling_type: str | None  # None: a request that generates
    arrival_step: int


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[Item], int, int, bool, str]:
    shared = draw(st.lists(st.integers(1, 999), min_size=0, max_size=24))  # prefixes the cache can hit
    items = []
    for _ in range(draw(st.integers(1, 8))):
        own = draw(st.lists(st.integers(1, 999), min_size=1, max_size=40))
        prompt = (shared[: draw(st.integers(0, len(shared)))] + own) if draw(st.booleans()) else own
        items.append(Item(prompt, draw(st.sampled_from([None, "last", "mean", "cls"])), draw(st.integers(0, 6))))
    budget = draw(st.integers(4, 48))
    num_blocks = draw(st.integers(20, 48))  # small pools preempt
    return items, budget, num_blocks, draw(st.booleans()), draw(st.sampled_from(["continuous", "static"]))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_pooled_position_counts_once_however_the_prompt_is_scheduled(case) -> None:  # noqa: ANN001
    items, budget, num_blocks, prefix_caching, policy = case
    runner = PoolingRunner()
    engine = fake_engine(runner, policy, block_size=4, num_blocks=num_blocks, budget=budget, max_model_len=80,
                         prefix_caching=prefix_caching)
    ids: dict[str, Item] = {}
    results: dict[str, list[float] | None] = {}
    step = 0
    while len(ids) < len(items) or engine.has_unfinished_requests:
        for item in items:
            if item.arrival_step == step:
                params = (SamplingParams(max_tokens=6, temperature=0.0) if item.pooling_type is None
                          else SamplingParams.for_pooling(PoolingParams(item.pooling_type, normalize=False)))
                ids[engine.add_request(item.prompt, params)] = item
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.embedding
        step += 1
        assert step < 2000
    for request_id, item in ids.items():
        if item.pooling_type is None:
            assert results[request_id] is None
        else:
            assert results[request_id] == expected(item.prompt, item.pooling_type), (item, request_id)
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.block_tables == {}


def test_an_embedding_of_a_long_prompt_is_pooled_over_several_chunks_and_a_preemption() -> None:
    """The property's cases above must include what they are for: here, one prompt chunked four
    ways while a generating request grows until the pool preempts."""
    runner = PoolingRunner()
    engine = fake_engine(runner, block_size=4, num_blocks=12, budget=8, max_model_len=48)
    prompt = list(range(1, 41))
    generating = engine.add_request([7] * 5, SamplingParams(max_tokens=40, temperature=0.0))
    pooled = engine.add_request(prompt, SamplingParams.for_pooling(PoolingParams("mean", normalize=False)))
    results: dict[str, list[float] | None] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.embedding
    assert results[pooled] == expected(prompt, "mean")
    assert results[generating] is None
    assert runner.pooled_steps >= 5  # 40 rows at most 8 a step
    assert engine.scheduler.num_preemptions >= 1
