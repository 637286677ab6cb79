"""The scheduler with prefix caching: a request that starts holding no KV jumps over its cached full
blocks (never its last token), under both policies, after preemption, and for forks of n > 1."""
from __future__ import annotations

from conveyor.sampling.params import SamplingParams

from tests.scheduler.test_policies import Harness


def test_a_second_request_with_the_same_prompt_computes_only_past_the_cached_blocks() -> None:
    h = Harness(block_size=4, prefix_caching=True)
    h.add("A", 10, 2)
    assert h.step() == [("A", 10)]
    h.add("B", 10, 2)
    # Two full blocks (8 tokens) are cached; B computes tokens 8-9 only, and decodes with A.
    assert h.step() == [("A", 1), ("B", 2)]
    b = h.requests["B"]
    assert b.num_cached_tokens == 8 and h.requests["A"].num_cached_tokens == 0
    s = h.engine.scheduler
    assert s.prefix_cache_queries == 20 and s.prefix_cache_hits == 8
    h.run()
    assert h.outputs["B"][-1].num_cached_tokens == 8


def test_a_prompt_of_whole_blocks_recomputes_its_last_block() -> None:
    h = Harness(block_size=4, prefix_caching=True)
    h.add("A", 8, 1)
    h.run()
    h.add("B", 8, 1)
    assert h.step() == [("B", 4)], "the last token's logits are needed: its block is computed again"


def test_turn_two_hits_turn_ones_answer() -> None:
    h = Harness(block_size=4, prefix_caching=True)
    first = h.add("turn1", 6, 7)
    h.run()
    history = first.prompt_token_ids + first.output_token_ids  # 13 tokens, 12 computed
    h.engine.add_request(history + [1, 2, 3], SamplingParams(max_tokens=1), request_id="turn2")
    assert h.step() == [("turn2", 16 - 12)], "the answer's full blocks came from the cache"


def test_static_batch_members_hit_too() -> None:
    h = Harness("static", block_size=2, max_num_seqs=2, prefix_caching=True)
    h.add("A", 7, 1)
    h.run()
    h.add("B", 7, 1)
    h.add("C", 7, 1)
    # B and C form the batch; both start from A's 3 cached blocks.
    assert h.step() == [("B", 1), ("C", 1)]


def test_a_preempted_request_resumes_from_the_cache() -> None:
    # 5 blocks of 2 slots: A and B (4-token prompts) grow until one is preempted; its full blocks
    # stay cached (nobody needs the free blocks), so it comes back without recomputing them.
    h = Harness(block_size=2, num_blocks=5, prefix_caching=True)
    h.add("A", 4, 4)
    h.add("B", 4, 4, first_token=100)
    h.run()
    assert any(h.preempted), "the pool is small enough to preempt"
    victim = next(rid for step in h.preempted for rid in step)
    resumed = [n for step in h.trace[next(i for i, p in enumerate(h.preempted) if p) + 1 :]
               for rid, n in step if rid == victim]
    assert resumed[0] < h.requests[victim].num_prompt_tokens + 1, "it did not start from token 0"
    assert [o.token_ids for o in h.outputs[victim]][-1] == [o.token_ids for o in run_alone(victim, h)][-1]


def run_alone(rid: str, h: Harness):  # noqa: ANN201
    """The same request alone, without the cache."""
    r = h.requests[rid]
    solo = Harness(block_size=2, num_blocks=16)
    solo.engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=4, ignore_eos=True), request_id=rid)
    solo.run()
    return solo.outputs[rid]


def test_forks_keep_the_parents_cached_count() -> None:
    h = Harness(block_size=4, prefix_caching=True)
    h.add("A", 9, 1)
    h.run()
    h.engine.add_request(h.requests["A"].prompt_token_ids, SamplingParams(max_tokens=2, n=3, ignore_eos=True),
                         request_id="B")
    h.run()
    finals = [o for o in h.outputs["B"] if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert all(o.num_cached_tokens == 8 for o in finals)
    assert h.engine.scheduler.kv.usage().used_blocks == 0
