"""The `prefix` and `multi-turn` workloads, and the offline driver sending later turns with the
conversation so far (the previous turns' generated tokens included) after their think time."""
from __future__ import annotations

import math

from conveyor.bench.offline import run_offline
from conveyor.bench.workloads import WorkloadConfig, generate_requests, request_arrivals
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from tests.bench.test_offline import TimedFakeRunner, VirtualClock


def test_prefix_groups_share_their_prefix_and_nothing_else() -> None:
    cfg = WorkloadConfig(dataset="prefix", num_prompts=12, num_groups=3, prefix_len=40, input_len=8, output_len=5)
    requests = generate_requests(cfg)
    assert generate_requests(cfg) == requests
    assert all(r.prompt_len == 48 and r.output_len == 5 and r.follows is None for r in requests)
    for i, r in enumerate(requests):
        same = requests[i % 3]
        assert r.prompt_token_ids[:40] == same.prompt_token_ids[:40]
        assert i < 3 or r.prompt_token_ids[40:] != same.prompt_token_ids[40:]
    assert len({tuple(r.prompt_token_ids[:40]) for r in requests}) == 3


def test_multi_turn_conversations_chain_their_turns() -> None:
    cfg = WorkloadConfig(dataset="multi-turn", num_prompts=12, num_turns=4, input_len=20, turn_len=6, output_len=5,
                         think_time=2.0)
    requests = generate_requests(cfg)
    assert [r.follows for r in requests] == [None] * 3 + list(range(9))
    assert all(r.prompt_len == 6 and r.think_time > 0 for r in requests[3:])
    arrivals = request_arrivals(requests, 1.0, seed=0)
    assert all(not math.isnan(t) for t in arrivals[:3]) and all(math.isnan(t) for t in arrivals[3:])


def test_later_turns_carry_the_history_and_wait_for_the_previous_turn() -> None:
    clock = VirtualClock()
    config = EngineConfig.from_kwargs(max_num_seqs=8, max_num_batched_tokens=256, block_size=4)
    runner = TimedFakeRunner(clock)
    engine = LLMEngine(config, runner, num_kv_blocks=256, max_model_len=1024, vocab_size=1000, clock=clock)
    cfg = WorkloadConfig(dataset="multi-turn", num_prompts=6, num_turns=3, input_len=20, turn_len=6, output_len=5,
                         think_time=0.5, vocab_size=1000)
    requests = generate_requests(cfg)
    result = run_offline(engine, requests, request_arrivals(requests, 10.0), sleep=clock.sleep)
    assert all(r.success for r in result.records)
    sent = {}  # request index -> the prompt the engine saw, from the runner's steps
    outputs = {}
    for out in runner.steps:
        for r, _ in out.scheduled:
            sent[int(r.request_id)] = r.prompt_token_ids
            outputs[int(r.request_id)] = r.output_token_ids
    for i, r in enumerate(requests):
        if r.follows is None:
            assert sent[i] == r.prompt_token_ids
            continue
        j = r.follows
        assert sent[i] == sent[j] + outputs[j] + r.prompt_token_ids, "the next turn carries the whole history"
        rec, prev = result.records[i], result.records[j]
        assert rec.start >= prev.start + prev.latency + r.think_time - 1e-9, "sent after the previous turn + think"
        assert rec.prompt_len == len(sent[i])
    assert result.extra["prefix_cache_hit_rate"] > 0.5
    assert result.extra["cached_prompt_share"] > 0.5 and "ttft_mean_later_turns_ms" in result.extra
