"""Focused examples of what each policy decides, step by step, through LLMEngine + FakeRunner."""
from __future__ import annotations

from typing import Any

import pytest

from conveyor.engine.outputs import RequestOutput
from conveyor.request import Request, RequestStatus
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler import ContinuousScheduler, StaticScheduler
from tests.fakes import FakeRunner, fake_engine

Trace = list[list[tuple[str, int]]]


class Harness:
    """An engine on a FakeRunner plus a record of every step: who got how many tokens, who was
    preempted, who finished, and what was streamed."""

    # prefix_caching off by default: the traces below assume every prompt is computed whole.
    def __init__(self, policy: str = "continuous", *, prefix_caching: bool = False, **options: Any) -> None:
        self.runner = FakeRunner()
        self.engine = fake_engine(self.runner, policy, prefix_caching=prefix_caching, **options)
        self.trace: Trace = []
        self.preempted: list[list[str]] = []
        self.finished_at: dict[str, int] = {}
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.requests: dict[str, Request] = {}

    def add(self, rid: str, prompt_len: int, max_tokens: int, first_token: int = 7, priority: int = 0) -> Request:
        prompt = [(first_token + i) % 1000 for i in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority)
        self.engine.add_request(prompt, params, request_id=rid)
        self.requests[rid] = self.engine.scheduler.requests[rid]
        return self.requests[rid]

    def step(self) -> list[tuple[str, int]]:
        n = len(self.runner.steps)
        outs = self.engine.step()
        if len(self.runner.steps) > n:
            out = self.runner.steps[-1]
            self.trace.append([(r.request_id, k) for r, k in out.scheduled])
            self.preempted.append([r.request_id for r in out.preempted])
        else:
            self.trace.append([])
            self.preempted.append([])
        for o in outs:
            self.outputs.setdefault(o.request_id, []).append(o)
            if o.finished:
                self.finished_at[o.request_id] = len(self.trace) - 1
        return self.trace[-1]

    def run(self, arrivals: dict[int, list[tuple[str, int, int]]] | None = None, max_steps: int = 1000) -> Trace:
        arrivals = arrivals or {}
        while self.engine.has_unfinished_requests or any(s >= len(self.trace) for s in arrivals):
            assert len(self.trace) < max_steps
            for rid, p, m in arrivals.get(len(self.trace), []):
                self.add(rid, p, m)
            self.step()
        return self.trace

    def first_step(self, rid: str) -> int:
        return next(i for i, step in enumerate(self.trace) if any(r == rid for r, _ in step))

    def waiting_ids(self) -> list[str]:
        return [r.request_id for r in self.engine.scheduler.waiting]


def solo_tokens(prompt_len: int, max_tokens: int, first_token: int = 7) -> list[int]:
    h = Harness()
    r = h.add("solo", prompt_len, max_tokens, first_token)
    h.run()
    return r.output_token_ids


# --- continuous: admission ----------------------------------------------------------------------
def test_continuous_admits_a_waiting_request_the_step_after_one_finishes_seq_cap() -> None:
    h = Harness(max_num_seqs=2)
    h.run({0: [("A", 4, 2), ("B", 4, 6), ("C", 4, 1)]})
    assert h.trace[0] == [("A", 4), ("B", 4)]  # C waits: two sequences at most
    assert h.trace[1] == [("A", 1), ("B", 1)]
    assert h.finished_at["A"] == 1
    assert h.trace[2] == [("B", 1), ("C", 4)]  # the very next step, while B is still running
    assert h.first_step("C") == h.finished_at["A"] + 1


def test_continuous_admits_a_waiting_request_the_step_after_one_finishes_kv_cap() -> None:
    # 3 blocks of 4: A (8 tokens) and B (4) take all of them; C (4) needs one more.
    h = Harness(num_blocks=3)
    h.run({0: [("A", 8, 1), ("B", 4, 3), ("C", 4, 1)]})
    assert h.trace[0] == [("A", 8), ("B", 4)]
    assert h.finished_at["A"] == 0
    assert h.trace[1] == [("B", 1), ("C", 4)]
    assert h.engine.scheduler.num_preemptions == 0


def test_continuous_joins_arrivals_at_the_next_step() -> None:
    h = Harness()
    h.add("A", 3, 6)
    h.step()
    h.step()
    h.add("B", 2, 2)
    assert h.step() == [("A", 1), ("B", 2)]


# --- continuous: order ----------------------------------------------------------------------------
def test_running_requests_are_served_before_waiting_ones() -> None:
    h = Harness()
    h.add("A", 3, 5)
    h.add("B", 5, 5)
    assert h.step() == [("A", 3), ("B", 5)]
    h.add("C", 4, 2)
    h.add("D", 2, 2)
    assert h.step() == [("A", 1), ("B", 1), ("C", 4), ("D", 2)]
    assert h.step() == [("A", 1), ("B", 1), ("C", 1), ("D", 1)]


def test_waiting_requests_are_admitted_fcfs_without_skipping_the_head() -> None:
    # Chunking off, budget 12: while A and B decode (2 tokens), C's 11-token prompt does not fit the
    # remaining 10, and D (2 tokens), which would fit, must not overtake it.
    h = Harness(budget=12, chunked=False)
    h.run({0: [("A", 2, 5), ("B", 2, 5)], 1: [("C", 11, 1), ("D", 2, 2)]})
    assert h.trace[0] == [("A", 2), ("B", 2)]
    for s in range(1, 5):
        assert h.trace[s] == [("A", 1), ("B", 1)]
    assert h.finished_at["A"] == h.finished_at["B"] == 4
    assert h.trace[5] == [("C", 11)]  # D's 2 tokens do not fit next to C's 11
    assert h.trace[6] == [("D", 2)]
    assert h.first_step("C") < h.first_step("D")


def test_fcfs_when_the_head_does_not_fit_the_pool() -> None:
    # 6 blocks of 2 slots. A (prompt 6) holds 3 blocks, then 4 as it decodes: 2 are left. B (prompt
    # 8) needs 4 and must wait; C (prompt 2) needs 1 and would fit, but may not overtake B.
    h = Harness(block_size=2, num_blocks=6)
    h.add("A", 6, 5)
    assert h.step() == [("A", 6)]
    h.add("B", 8, 1)
    h.add("C", 2, 1)
    assert h.step() == [("A", 1)]
    assert h.engine.scheduler.kv.num_free_blocks == 2
    assert h.waiting_ids() == ["B", "C"]
    h.run()
    assert h.first_step("B") == h.finished_at["A"] + 1
    assert h.first_step("B") <= h.first_step("C")
    assert h.engine.scheduler.num_preemptions == 0


# --- chunked prefill --------------------------------------------------------------------------
def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_chunks_riding_with_decodes() -> None:
    h = Harness(budget=8)
    h.run({0: [("A", 3, 10)], 1: [("B", 20, 2)]})
    assert h.trace[0] == [("A", 3)]
    assert h.trace[1] == [("A", 1), ("B", 7)]
    assert h.trace[2] == [("A", 1), ("B", 7)]
    assert h.trace[3] == [("A", 1), ("B", 6)]  # the last chunk completes the prompt: B samples
    assert h.trace[4] == [("A", 1), ("B", 1)]
    assert h.trace[5:] == [[("A", 1)]] * 5
    assert all(sum(n for _, n in step) <= 8 for step in h.trace)
    # No token for B until its whole prompt is computed; A got one token every step.
    assert [len(o.new_token_ids) for o in h.outputs["B"]] == [1, 1]
    assert h.requests["B"].times.tokens[0] > h.requests["B"].times.first_scheduled
    assert len(h.outputs["A"]) == 10
    assert h.requests["B"].output_token_ids == solo_tokens(20, 2)


def test_chunked_prefill_two_long_prompts_share_the_budget() -> None:
    h = Harness(budget=8)
    h.run({0: [("B", 10, 2), ("C", 10, 2)]})
    assert h.trace == [
        [("B", 8)],  # C waits: no budget left
        [("B", 2), ("C", 6)],  # B completes its prompt; C's first chunk rides along
        [("B", 1), ("C", 4)],
        [("C", 1)],
    ]


def test_chunked_prefill_prompt_alone_is_split_by_the_budget() -> None:
    h = Harness(budget=8)
    h.run({0: [("X", 20, 1)]})
    assert h.trace == [[("X", 8)], [("X", 8)], [("X", 4)]]
    assert h.requests["X"].output_token_ids == solo_tokens(20, 1)


def test_without_chunked_prefill_a_long_prompt_is_scheduled_whole() -> None:
    h = Harness(budget=32, chunked=False)
    h.run({0: [("A", 3, 10)], 1: [("B", 20, 2)]})
    assert h.trace[1] == [("A", 1), ("B", 20)]
    assert [n for step in h.trace for r, n in step if r == "B"] == [20, 1]


def test_without_chunked_prefill_a_prompt_waits_for_room_rather_than_splitting() -> None:
    # Budget 21: with A and A2 decoding, 19 tokens are left for B's 20-token prompt.
    h = Harness(budget=21, chunked=False)
    h.run({0: [("A", 3, 4), ("A2", 3, 2)], 1: [("B", 20, 1)]})
    assert h.trace[1] == [("A", 1), ("A2", 1)]
    assert h.waiting_ids() == [] and h.finished_at["A2"] == 1
    assert h.trace[2] == [("A", 1), ("B", 20)]
    assert [n for step in h.trace for r, n in step if r == "B"] == [20]


# --- preemption -------------------------------------------------------------------------------
def test_preemption_picks_the_most_recent_and_recomputes_from_zero() -> None:
    # 4 blocks of 2 slots. A and B (3-token prompts) each hold 2 blocks after step 0; at step 2 A
    # needs a third block, and B, admitted after A, gives way.
    h = Harness(block_size=2, num_blocks=4)
    a = h.add("A", 3, 4)
    b = h.add("B", 3, 4, first_token=50)
    h.add("C", 1, 1)
    assert h.step() == [("A", 3), ("B", 3)]
    assert h.waiting_ids() == ["C"]
    assert h.step() == [("A", 1), ("B", 1)]
    assert h.step() == [("A", 1)]
    assert h.preempted[-1] == ["B"]
    # B goes back to the front of the queue, ahead of C, with nothing computed and no blocks.
    assert h.waiting_ids() == ["B", "C"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert "B" not in h.engine.scheduler.kv.block_tables
    assert b.num_preemptions == 1 and h.engine.scheduler.num_preemptions == 1
    assert len(b.output_token_ids) == 2  # its tokens so far are kept
    assert h.engine.last_step.num_preempted == 1
    h.run()
    assert h.finished_at["A"] == 3
    # B recomputes prompt + both outputs (5 tokens) in one go, before C.
    assert h.trace[4] == [("B", 5), ("C", 1)]
    assert a.output_token_ids == solo_tokens(3, 4)
    assert b.output_token_ids == solo_tokens(3, 4, first_token=50)
    assert h.outputs["B"][-1].num_preemptions == 1 and h.outputs["A"][-1].num_preemptions == 0
    assert len(h.outputs["B"]) == 4  # no token streamed twice because of the recompute
    assert h.engine.scheduler.kv.num_free_blocks == 4


def test_preemption_takes_the_newest_not_the_one_that_needs_the_block() -> None:
    # One slot per block, 7 blocks. A, B, C hold 2 each after step 0. At step 1 A takes the last
    # free block; B then needs one, and C (newest) is evicted, not B.
    h = Harness(block_size=1, num_blocks=7)
    h.run({0: [("A", 2, 3), ("B", 2, 3), ("C", 2, 3)], 1: [("D", 1, 1)]})
    assert h.trace[0] == [("A", 2), ("B", 2), ("C", 2)]
    assert h.trace[1] == [("A", 1), ("B", 1)]
    assert h.preempted[1] == ["C"]
    assert h.preempted[2] == ["B"]  # now B is the newest running request
    # Both go back in admission order, ahead of D, and recompute everything they have.
    assert h.trace[3] == [("B", 4), ("C", 3)]
    assert h.first_step("D") == 4
    assert h.engine.scheduler.num_preemptions == 2
    for rid in "ABC":
        assert h.requests[rid].output_token_ids == solo_tokens(2, 3)


def test_continuous_does_not_admit_in_a_step_that_preempts() -> None:
    # 3 one-slot blocks, budget 2. At step 1 A takes the last free block and B must give way. The
    # budget (1 token) and B's freed block would let B straight back in as a 1-token chunk, which
    # would only hand the block back and forth: nobody is admitted in a step that preempts.
    h = Harness(block_size=1, num_blocks=3, budget=2)
    h.run({0: [("A", 1, 2), ("B", 1, 2)]})
    assert h.trace == [[("A", 1), ("B", 1)], [("A", 1)], [("B", 2)]]
    assert h.preempted == [[], ["B"], []]
    assert h.requests["B"].output_token_ids == solo_tokens(1, 2)


# --- static -----------------------------------------------------------------------------------
def test_static_admits_nobody_until_the_whole_batch_is_done() -> None:
    h = Harness("static", max_num_seqs=2)
    h.run({0: [("A", 2, 1), ("B", 2, 5), ("C", 2, 1)]})
    assert h.trace[0] == [("A", 2), ("B", 2)]
    assert h.finished_at["A"] == 0
    assert h.trace[1:5] == [[("B", 1)]] * 4  # C waits although A's slot is idle
    assert h.finished_at["B"] == 4
    assert h.trace[5] == [("C", 2)]


def test_static_finished_members_keep_their_slot() -> None:
    h = Harness("static", max_num_seqs=2)
    h.add("A", 2, 1)
    h.add("B", 2, 5)
    h.add("C", 2, 1)
    h.step()
    sched = h.engine.scheduler
    assert isinstance(sched, StaticScheduler)
    assert h.requests["A"].is_finished
    assert sched.batch_size == 2 and sched.num_running == 1
    assert [r.request_id for r in sched.batch] == ["A", "B"]
    assert h.waiting_ids() == ["C"]
    assert "A" not in h.engine.scheduler.kv.block_tables  # the slot is kept, the KV memory is not


def test_continuous_on_the_same_workload_admits_at_once() -> None:
    h = Harness("continuous", max_num_seqs=2)
    h.run({0: [("A", 2, 1), ("B", 2, 5), ("C", 2, 1)]})
    assert h.trace[1] == [("B", 1), ("C", 2)]


def test_static_forms_fcfs_batches_of_max_num_seqs() -> None:
    h = Harness("static", max_num_seqs=2)
    lengths = {"r0": 3, "r1": 1, "r2": 1, "r3": 4, "r4": 2}
    h.run({0: [(rid, 2, m) for rid, m in lengths.items()]})
    batches = [["r0", "r1"], ["r2", "r3"], ["r4"]]
    for i, batch in enumerate(batches):
        start = min(h.first_step(r) for r in batch)
        assert h.trace[start] == [(r, 2) for r in batch]
        if i:
            prev_end = max(h.finished_at[r] for r in batches[i - 1])
            assert start == prev_end + 1
        for s in range(start, max(h.finished_at[r] for r in batch) + 1):
            assert {r for r, _ in h.trace[s]} <= set(batch)


def test_static_batch_ends_when_its_last_member_is_aborted() -> None:
    h = Harness("static", max_num_seqs=2)
    h.add("A", 2, 1)
    h.add("B", 2, 10)
    h.add("C", 2, 1)
    h.step()
    h.step()
    assert h.engine.abort_request("B")
    assert h.engine.scheduler.kv.num_free_blocks == h.engine.scheduler.kv.num_blocks
    assert h.step() == [("C", 2)]


def test_static_preempts_within_the_batch_and_still_finishes_it() -> None:
    h = Harness("static", block_size=1, num_blocks=7, max_num_seqs=3)
    h.run({0: [("A", 2, 3), ("B", 2, 3), ("C", 2, 3), ("D", 1, 1)]})
    assert h.engine.scheduler.num_preemptions > 0
    victims = [r for step in h.preempted for r in step]
    assert victims[0] == "C"
    assert h.first_step("D") > max(h.finished_at[r] for r in "ABC")
    for rid in "ABC":
        assert h.requests[rid].output_token_ids == solo_tokens(2, 3)


# --- abort ------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_abort_of_waiting_and_running_requests_frees_everything(policy: str) -> None:
    h = Harness(policy, max_num_seqs=1, block_size=4, num_blocks=10)
    a = h.add("A", 9, 5)
    b = h.add("B", 4, 5)
    h.step()
    kv = h.engine.scheduler.kv
    assert len(kv.block_tables["A"]) == 3 and kv.num_free_blocks == 7  # 9 tokens in blocks of 4
    assert h.waiting_ids() == ["B"]

    assert h.engine.abort_request("B") is True  # waiting
    assert b.status is RequestStatus.FINISHED_ABORTED and b.status.value == "abort"
    assert b.times.finished is not None and b.times.first_scheduled is None
    assert h.waiting_ids() == [] and "B" not in h.engine.scheduler.requests
    assert kv.num_free_blocks == 7

    assert h.engine.abort_request("A") is True  # running, holding 3 blocks
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert kv.num_free_blocks == 10 and kv.block_tables == {}
    if isinstance(h.engine.scheduler, ContinuousScheduler):
        assert h.engine.scheduler.running == []
    assert h.engine.scheduler.num_running == 0
    assert not h.engine.has_unfinished_requests

    assert h.engine.abort_request("A") is False  # already finished
    assert h.engine.abort_request("nope") is False  # never existed
    assert h.step() == []
    assert len(a.output_token_ids) == 1


def test_abort_of_a_finished_request_changes_nothing() -> None:
    h = Harness()
    r = h.add("A", 2, 1)
    h.run()
    assert r.status is RequestStatus.FINISHED_LENGTH
    finished = r.times.finished
    assert h.engine.abort_request("A") is False
    assert r.status is RequestStatus.FINISHED_LENGTH and r.times.finished == finished


def test_aborted_id_can_be_reused_and_a_live_one_cannot() -> None:
    from conveyor.errors import InvalidRequestError

    h = Harness()
    h.add("A", 2, 3)
    with pytest.raises(InvalidRequestError):
        h.add("A", 2, 3)
    h.engine.abort_request("A")
    h.add("A", 3, 2)
    h.run()
    assert h.requests["A"].output_token_ids == solo_tokens(3, 2)


# --- timestamps -------------------------------------------------------------------------------
def check_times(r: Request) -> None:
    t = r.times
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished
    assert t.first_token == t.tokens[0]
    assert all(x <= y for x, y in zip(t.tokens, t.tokens[1:]))
    assert t.tokens[-1] <= t.finished
    assert len(t.tokens) == len(r.output_token_ids)


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_timestamps_are_ordered(policy: str) -> None:
    h = Harness(policy, block_size=2, num_blocks=6, budget=6, max_num_seqs=3)
    h.run({0: [("A", 9, 3), ("B", 2, 5)], 1: [("C", 3, 2)], 3: [("D", 1, 4)]})
    for rid, r in h.requests.items():
        check_times(r)
        assert h.outputs[rid][-1].times is r.times
    # Strictly later with a ticking clock: scheduled after arrival, A's 9-token prompt takes two
    # chunks, so its first token comes a step after it was first scheduled.
    a = h.requests["A"].times
    assert a.arrival < a.first_scheduled < a.first_token
    assert h.requests["A"].times.first_scheduled < h.requests["A"].times.tokens[0]


def test_first_scheduled_survives_preemption() -> None:
    h = Harness(block_size=2, num_blocks=4)
    h.add("A", 3, 4)
    b = h.add("B", 3, 4)
    h.add("C", 1, 1)
    h.step()
    first = b.times.first_scheduled
    first_token = b.times.first_token
    h.run()
    assert b.num_preemptions == 1
    assert b.times.first_scheduled == first and b.times.first_token == first_token
    check_times(b)


def test_explicit_arrival_time_and_real_clock() -> None:
    import time

    h = Harness(clock=time.perf_counter)
    start = time.perf_counter()
    h.engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), request_id="X",
                         arrival_time=start - 1.0)
    x = h.engine.scheduler.requests["X"]
    h.add("Y", 2, 2)
    h.run()
    assert x.times.arrival == start - 1.0
    check_times(x)
    check_times(h.requests["Y"])
    assert h.requests["Y"].times.arrival >= start


def test_abort_timestamp() -> None:
    h = Harness()
    r = h.add("A", 2, 5)
    h.step()
    h.engine.abort_request("A")
    assert r.times.arrival <= r.times.first_scheduled <= r.times.first_token <= r.times.finished


# --- priority scheduling ------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_priority_admits_the_most_urgent_waiting_request_first(policy: str) -> None:
    h = Harness(policy, max_num_seqs=1, scheduling_policy="priority")
    h.add("first", 4, 3)
    h.step()  # it runs alone; the rest queue behind it
    for rid, priority in (("low", 5), ("urgent", -1), ("normal", 0), ("low too", 5), ("urgent too", -1)):
        h.add(rid, 4, 2, priority=priority)
    assert h.waiting_ids() == ["urgent", "urgent too", "normal", "low", "low too"]
    h.run()
    order = sorted(h.finished_at, key=h.finished_at.__getitem__)
    assert order == ["first", "urgent", "urgent too", "normal", "low", "low too"]


def test_priority_preempts_the_least_urgent_and_serves_the_most_urgent_first() -> None:
    # Three requests grow into a pool that holds two: the least urgent is preempted, whatever the
    # order they were admitted in, and the most urgent gets its tokens first each step.
    h = Harness(block_size=2, num_blocks=6, max_num_seqs=3, scheduling_policy="priority")
    h.add("low", 2, 6, priority=3)
    h.add("high", 2, 6, first_token=20, priority=-3)
    h.add("mid", 2, 6, first_token=40, priority=0)
    h.step()
    assert [rid for rid, _ in h.trace[0]] == ["high", "mid", "low"]
    h.run()
    preempted = [rid for step in h.preempted for rid in step]
    assert preempted and set(preempted) <= {"low", "mid"} and preempted[0] == "low"
    assert h.finished_at["high"] <= min(h.finished_at["mid"], h.finished_at["low"])
    for rid, first in (("low", 7), ("high", 20), ("mid", 40)):
        assert h.requests[rid].output_token_ids == solo_tokens(2, 6, first)


def test_a_priority_needs_priority_scheduling() -> None:
    from conveyor.errors import InvalidRequestError

    h = Harness()
    with pytest.raises(InvalidRequestError) as refused:
        h.add("x", 4, 2, priority=1)
    assert refused.value.param == "priority" and not h.engine.has_unfinished_requests
    h.add("zero", 4, 2, priority=0)  # the default priority is every request's under FCFS
