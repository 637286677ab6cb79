"""Property tests: LLMEngine + a fake runner under random arrivals, sizes, pools, policies, aborts.

The runner models the paged KV cache: every computed token writes into the slot its block table gives
what a real forward would (a function of the whole sequence up to it), a request's already computed
prefix must read back exactly that (whether it computed it or a prefix-cache hit gave it the block),
nobody writes into a block someone else holds, and the sampled token is a function of the last slot
read back. So outputs equal the solo run only if preemption, recompute, chunking, forks with
copy-on-write, prefix hits and block ownership are all right.
"""
from __future__ import annotations

import dataclasses
import functools
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from conveyor.config import SchedulerConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.errors import InvalidRequestError
from conveyor.kv.manager import NULL_BLOCK, KVCacheManager, SlidingWindow, blocks_for
from conveyor.request import Request, RequestStatus
from conveyor.sampling.outputs import SamplerOutput
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler import ContinuousScheduler, make_scheduler
from conveyor.scheduler.queue import priority_key
from tests.fakes import FakeRunner, fake_engine

VOCAB = 1000


def prefix_hashes(seq: list[int]) -> list[int]:
    """What a forward writes at each position: it depends on every token up to it."""
    h, out = 0, []
    for t in seq:
        h = (h * 1_000_003 + t + 1) % 2_305_843_009_213_693_951
        out.append(h)
    return out


class PagedRunner(FakeRunner):
    """FakeRunner's bookkeeping plus a model of the slots, and tokens that depend on their content."""

    def __init__(self) -> None:
        super().__init__(VOCAB)
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (position, what the forward wrote)
        # The same for sliding-window layers with a pool of their own (kv_window, set by make_engine).
        self.window_slots: dict[int, tuple[int, int]] = {}
        self.kv_window: SlidingWindow | None = None
        self.free_at_execute: list[int] = []
        self.split_prefill = False  # some step computed fewer tokens than the request had pending
        self.window_dropped = False  # a window table gave back blocks out of sight
        self.kv: KVCacheManager | None = None  # the engine's, to check the decisions against

    def execute(self, out, stats):  # noqa: ANN001, ANN201 - Runner protocol
        super().execute(out, stats)  # records the step, checks sampling requests have slots
        kv = self.kv
        assert kv is not None
        self.free_at_execute.append(kv.num_free_blocks)
        bs = kv.block_size
        for slots, copies in ((self.slots, out.block_copies), (self.window_slots, out.window_block_copies)):
            for src, dst in copies:  # copy-on-write before the forward, as the real runner does
                for offset in range(bs):
                    if src * bs + offset in slots:
                        slots[dst * bs + offset] = slots[src * bs + offset]
        assert bool(out.window_tables) == (kv.window is not None and bool(out.scheduled))
        seen: set[str] = set()
        for parent, child in out.forks:
            assert kv.block_tables[child.request_id] == kv.block_tables[parent.request_id]
        for request, n in out.scheduled:
            rid = request.request_id
            assert rid not in seen, f"{rid} scheduled twice in one step"
            seen.add(rid)
            assert not request.is_finished
            assert 1 <= n <= request.num_pending_tokens
            self.split_prefill |= n < request.num_pending_tokens
            table = kv.block_tables[rid]
            start, end = request.num_computed_tokens, request.num_computed_tokens + n
            assert len(table) * bs >= end, f"{rid} computes tokens up to {end} without slots"
            assert kv.num_slotted_tokens[rid] >= end
            written = prefix_hashes(request.token_slice(0, end))
            # The computed prefix (computed here, or a prefix hit's blocks) holds what recompute would write.
            for pos in range(start):
                assert self.slots.get(table[pos // bs] * bs + pos % bs) == (pos, written[pos]), f"{rid} at {pos}"
            # Nobody writes into a block someone else holds, but for the samples that fork off it
            # this step (they share the prompt's KV being written).
            sharers = 1 + sum(1 for parent, _ in out.forks if parent is request)
            for pos in range(start, end):
                assert kv.pool.ref_count(table[pos // bs]) <= sharers, f"{rid} writes into a shared block"
                self.slots[table[pos // bs] * bs + pos % bs] = (pos, written[pos])
            if kv.window is not None:
                # The window layers: what this step's queries see before `start` holds what recompute
                # would write, whoever wrote it; new tokens go to real, unshared blocks.
                window, pool = out.window_tables[rid], kv.window_pool
                assert pool is not None and len(window) == len(table)
                self.window_dropped |= NULL_BLOCK in window
                for pos in range(max(0, start - kv.window.tokens + 1), start):
                    slot = window[pos // bs] * bs + pos % bs
                    assert window[pos // bs] != NULL_BLOCK, f"{rid} lost a window block in sight at {pos}"
                    assert self.window_slots.get(slot) == (pos, written[pos]), f"{rid} window at {pos}"
                for pos in range(start, end):
                    block = window[pos // bs]
                    assert block != NULL_BLOCK and pool.ref_count(block) <= sharers, f"{rid} window write at {pos}"
                    self.window_slots[block * bs + pos % bs] = (pos, written[pos])
        tokens = []
        for request in out.sampling_requests():
            table = kv.block_tables[request.request_id]
            last = request.num_tokens - 1
            tokens.append(self.slots[table[last // bs] * bs + last % bs][1] % VOCAB)
        return SamplerOutput(tokens)


def make_engine(policy: str = "continuous", *, max_model_len: int = 1024, window: SlidingWindow | None = None,
                **options: Any) -> tuple[LLMEngine, PagedRunner]:
    """fake_engine (tests/fakes.py) on a PagedRunner, which records what each KV slot holds;
    `window`: its sliding-window layers' pool."""
    runner = PagedRunner()
    runner.kv_window = window
    engine = fake_engine(runner, policy, max_model_len=max_model_len, **options)
    runner.kv = engine.scheduler.kv
    return engine, runner


@functools.cache
def solo(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """The request's tokens when it runs alone in a roomy engine."""
    total = len(prompt) + max_tokens
    engine, _ = make_engine(
        num_blocks=blocks_for(total, 4) + 4, budget=total + 8, max_model_len=total + 8, prefix_caching=False
    )
    rid = engine.add_request(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    request = engine.scheduler.requests[rid]
    while engine.has_unfinished_requests:
        engine.step()
    assert request.status is RequestStatus.FINISHED_LENGTH
    return tuple(request.output_token_ids)


# --- state checks ---------------------------------------------------------------------------------
def members(engine: LLMEngine) -> list[Request]:
    s = engine.scheduler
    return list(s.running) if isinstance(s, ContinuousScheduler) else list(s.batch)


def engine_state(engine: LLMEngine) -> tuple:
    s, kv = engine.scheduler, engine.scheduler.kv
    return (
        sorted(s.requests),
        [r.request_id for r in s.waiting],
        [r.request_id for r in members(engine)],
        {k: list(v) for k, v in kv.block_tables.items()},
        dict(kv.num_slotted_tokens),
        list(kv.pool._free),
        list(kv.pool._evictable),
        list(kv.pool._ref_counts),
        s.num_preemptions,
        sorted((r.request_id, r.status, r.num_computed_tokens, len(r.output_token_ids)) for r in s.requests.values()),
    )


def check_blocks(engine: LLMEngine) -> None:
    kv, pool = engine.scheduler.kv, engine.scheduler.kv.pool
    owners: dict[int, int] = defaultdict(int)
    for table in kv.block_tables.values():
        assert len(set(table)) == len(table)
        for b in table:
            owners[b] += 1
    assert pool.num_free + len(owners) == kv.num_blocks, "blocks leaked or double counted"
    free = set(pool._free) | set(pool._evictable)
    assert len(free) == pool.num_free and not free & set(owners), "a block both free and owned"
    for b in range(kv.num_blocks):
        assert pool.ref_count(b) == owners.get(b, 0), f"ref count of block {b} is not its number of owners"
    assert all(pool.key_of(b) is not None for b in pool._evictable)
    assert all(pool.key_of(b) is None for b in pool._free)
    window_pool = kv.window_pool
    assert (window_pool is None) == (kv.window is None)
    if window_pool is not None:
        assert set(kv.window_tables) == set(kv.block_tables)
        window_owners: dict[int, int] = defaultdict(int)
        for rid, window in kv.window_tables.items():
            assert len(window) == len(kv.block_tables[rid])
            first = kv.first_visible_block(kv.num_slotted_tokens[rid])
            held = [b for b in window if b != NULL_BLOCK]
            assert len(set(held)) == len(held)
            assert all(b == NULL_BLOCK for b in window[: kv._num_dropped.get(rid, 0)])
            assert kv._num_dropped.get(rid, 0) <= first or first == 0
            assert NULL_BLOCK not in window[kv._num_dropped.get(rid, 0):], "a hole inside a window table"
            for b in held:
                window_owners[b] += 1
        assert window_pool.ref_count(NULL_BLOCK) == 1 and window_pool.key_of(NULL_BLOCK) is None
        assert window_pool.num_free + len(window_owners) + 1 == window_pool.num_blocks, "window blocks leaked"
        for b in range(1, window_pool.num_blocks):
            assert window_pool.ref_count(b) == window_owners.get(b, 0), f"ref count of window block {b}"
    if not kv.enable_prefix_caching:
        assert pool.num_cached == 0
    usage = kv.usage()
    assert usage.wasted_slots <= (kv.block_size - 1) * usage.num_requests


def check_requests(engine: LLMEngine, cfg: SchedulerConfig, accepted: dict[str, Request]) -> None:
    s, kv = engine.scheduler, engine.scheduler.kv
    waiting = list(s.waiting)
    mem = members(engine)
    assert len({id(r) for r in waiting}) == len(waiting)
    assert not {id(r) for r in waiting} & {id(r) for r in mem}
    assert s.num_running <= cfg.max_num_seqs
    assert len(mem) <= cfg.max_num_seqs
    assert set(kv.block_tables) <= set(s.requests)
    for rid, r in accepted.items():
        if r.is_finished:
            assert rid not in kv.block_tables, f"finished {rid} holds blocks"
            assert rid not in s.requests
            assert all(w is not r for w in waiting)
            if isinstance(s, ContinuousScheduler):
                assert all(m is not r for m in mem)
            continue
        assert s.requests.get(rid) is r
        assert any(w is r for w in waiting) or any(m is r for m in mem)
        assert 0 <= r.num_computed_tokens < r.num_tokens  # something is always pending
        # A hit never covers the last prompt token: its logits give the first output token.
        assert r.num_cached_tokens is None or 0 <= r.num_cached_tokens < r.num_prompt_tokens
        if r.status is RequestStatus.WAITING:
            assert rid not in kv.block_tables and r.num_computed_tokens == 0
        else:
            assert r.status is RequestStatus.RUNNING
            assert kv.num_slotted_tokens[rid] >= r.num_computed_tokens
        if isinstance(s, ContinuousScheduler):
            assert (r.status is RequestStatus.RUNNING) == any(m is r for m in mem)


def service_order(s, admitted: list[Request]) -> list[Request]:  # noqa: ANN001
    """Who gets tokens first: admission order, or by priority the lowest key (admission order among
    equal keys)."""
    return sorted(admitted, key=priority_key) if s.waiting.by_priority else list(admitted)


def victim_order(s, admitted: list[Request]) -> list[Request]:  # noqa: ANN001
    """Who is preempted first: service order, backwards."""
    return list(reversed(service_order(s, admitted)))


def check_decision(  # noqa: ANN001
    engine, runner, cfg, before_waiting, before_members, before_all_finished, before_holding, n_steps_before,
    before_seats,
) -> None:
    """What one schedule() may decide, given the queues just before it."""
    s = engine.scheduler
    if len(runner.steps) == n_steps_before:
        return
    out = runner.steps[-1]
    free_at_execute = runner.free_at_execute[-1]
    scheduled = [r for r, _ in out.scheduled]
    assert out.num_tokens <= cfg.max_num_batched_tokens
    assert len(scheduled) <= cfg.max_num_seqs
    # The members at decision time: the running list before the step, or the (maybe new) static batch.
    sched_members = before_members if isinstance(s, ContinuousScheduler) else members(engine)
    assert all(id(p) in {id(m) for m in sched_members} for p in out.preempted)
    if not cfg.chunked_prefill:
        # Whole pending tokens or nothing: every scheduled request caught up and sampled a token.
        for r in scheduled:
            assert r.num_computed_tokens == r.num_tokens - 1
    # Victims come from the end of the victim order (the newest admitted, or the least urgent): a
    # member that comes before a victim in it and held blocks was preempted too.
    worst_first = victim_order(s, sched_members)
    for p in out.preempted:
        before_it = worst_first[: [id(m) for m in worst_first].index(id(p))]
        for m in before_it:
            if m.request_id in before_holding:
                assert any(q is m for q in out.preempted), "preempted a request before a less urgent one"
    if s.waiting.by_priority:
        keys = [priority_key(r) for r in s.waiting]
        assert keys == sorted(keys), "the waiting queue is in priority order"
    if isinstance(s, ContinuousScheduler):
        run_ids = {id(r) for r in before_members}
        k = sum(1 for r in scheduled if id(r) in run_ids)
        old, new = scheduled[:k], scheduled[k:]
        assert all(id(r) in run_ids for r in old), "running requests are served before waiting ones"
        order = [id(r) for r in service_order(s, before_members)]
        assert [order.index(id(r)) for r in old] == sorted(order.index(id(r)) for r in old)
        assert [id(r) for r in new] == [id(r) for r in before_waiting[: len(new)]], "admission is FCFS"
        if out.preempted:
            assert not new, "no admission in a step that preempts"
            # Exactly the first of the victim order, in that order; under FCFS they go back to the
            # queue's front in admission order (by priority, the order check above covers them).
            k = len(out.preempted)
            assert [id(p) for p in out.preempted] == [id(r) for r in victim_order(s, before_members)][:k]
            for p in out.preempted:
                assert p.num_computed_tokens == 0 and p.request_id not in engine.scheduler.kv.block_tables
                assert p.status is RequestStatus.WAITING
            if not s.waiting.by_priority:
                assert [id(r) for r in list(s.waiting)[:k]] == [id(r) for r in before_members[-k:]]
        skipped = [r for r in before_members if r not in scheduled and r not in out.preempted]
        budget_left = cfg.max_num_batched_tokens - out.num_tokens
        if skipped:
            assert budget_left == 0 and not new, "a running request was skipped with budget left"
        if not out.preempted and len(new) < len(before_waiting) and not engine.scheduler.kv.enable_prefix_caching:
            head = before_waiting[len(new)]
            pending = head.num_tokens  # it held nothing, so everything is pending
            chunk = pending if not cfg.chunked_prefill or pending <= budget_left else budget_left
            seats = before_seats + sum(r.sampling_params.n for r in new)
            assert (
                seats + 1 + (head.sampling_params.n - 1 if not head.output_token_ids else 0) > cfg.max_num_seqs
                or budget_left == 0
                or (not cfg.chunked_prefill and pending > budget_left)
                or blocks_for(chunk, engine.scheduler.kv.block_size) > free_at_execute
                or engine.scheduler.kv.window is not None  # its window pool may be what is short
            ), "continuous left a waiting request out although it fitted"
    else:
        forked = {id(child) for _, child in out.forks}
        batch = [m for m in members(engine) if id(m) not in forked]  # the members before this step's forks
        assert all(any(m is r for m in batch) for r in scheduled)
        assert all(any(m is p for m in batch) for p in out.preempted)
        changed = [id(m) for m in batch] != [id(m) for m in before_members]
        if changed:
            assert before_all_finished, "static admitted while its batch still had unfinished members"
        if before_all_finished and before_waiting:
            k, seats = 0, 0  # a request of n samples takes n seats (the first always joins)
            while k < len(before_waiting) and (not seats or seats + before_waiting[k].sampling_params.n <= cfg.max_num_seqs):
                seats += before_waiting[k].sampling_params.n
                k += 1
            assert [id(m) for m in batch] == [id(r) for r in before_waiting[:k]], "static batch is FCFS"


# --- scenarios ------------------------------------------------------------------------------------
@dataclass
class Arrival:
    step: int
    prompt: list[int]
    max_tokens: int
    n: int = 1
    priority: int = 0


@dataclass
class Scenario:
    policy: str
    chunked: bool
    block_size: int
    num_blocks: int
    max_num_seqs: int
    budget: int
    max_model_len: int
    arrivals: list[Arrival]
    prefix_caching: bool = True
    aborts: list[tuple[int, str, int]] = field(default_factory=list)  # (step, kind, pick)
    duplicates: list[tuple[int, int]] = field(default_factory=list)  # (step, pick)
    scheduling_policy: str = "fcfs"
    window: SlidingWindow | None = None  # sliding-window layers with a pool of their own


@st.composite
def scenarios(draw, pressure: bool = False) -> Scenario:  # noqa: ANN001
    """pressure: tiny pools, bursts, several sequences and mostly short prompts (long outputs), so
    that running requests grow into each other and preemption is the normal case."""
    policy = draw(st.sampled_from(["continuous", "static"]))
    chunked = draw(st.booleans())
    block_size = draw(st.integers(1, 6))
    tiny = pressure or draw(st.booleans())
    num_blocks = draw(st.integers(2, 6) if pressure else st.integers(1, 8) if tiny else st.integers(1, 32))
    max_num_seqs = draw(st.integers(2, 6) if pressure else st.integers(1, 6))
    budget = draw(st.one_of(st.integers(1, 8), st.integers(1, 48)))
    max_model_len = draw(st.one_of(st.integers(2, 96), st.just(96)))
    cap = min(max_model_len, num_blocks * block_size, budget if not chunked else max_model_len)
    burst = pressure or draw(st.booleans())  # everything arrives within a few steps
    prefix_caching = draw(st.integers(0, 3).map(bool))
    stem = [random.Random(draw(st.integers(0, 2**32))).randrange(VOCAB) for _ in range(48)]
    arrivals: list[Arrival] = []
    for _ in range(draw(st.integers(2 if pressure else 1, 10))):
        step = draw(st.integers(0, 3) if burst else st.integers(0, 25))
        if cap >= 2 and draw(st.integers(0, 7)):
            # Half the time near the cap, so that requests crowd the pool and get preempted.
            total = draw(st.one_of(st.integers(2, cap), st.integers(max(2, cap // 2), cap)))
        else:  # usually too big for this engine; drawn against the limits, not the cap, sometimes fits
            total = draw(st.integers(2, max(2, cap) + 24))
        # Long outputs grow into the pool after admission.
        short_prompt = draw(st.integers(0, 3).map(bool) if pressure else st.booleans())
        if short_prompt:
            prompt_len = draw(st.integers(1, max(1, (total - 1) // 4)))
        else:
            prompt_len = draw(st.one_of(st.integers(1, total - 1), st.integers(max(1, (total - 1) // 2), total - 1)))
        rng = random.Random(draw(st.integers(0, 2**32)))
        tail = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        origin = draw(st.sampled_from(["fresh", "shared stem", "next turn"]))
        if origin == "shared stem":  # a system prompt: the stem's head, then the request's own tokens
            prompt = (stem[: draw(st.integers(0, prompt_len))] + tail)[:prompt_len]
        elif origin == "next turn" and arrivals:  # carries an earlier request's prompt and answer
            prev = arrivals[draw(st.integers(0, len(arrivals) - 1))]
            prompt = (prev.prompt + list(solo(tuple(prev.prompt), prev.max_tokens)) + tail)[:prompt_len]
        else:
            prompt = tail
        n = draw(st.sampled_from([1, 1, 2, 3]))
        arrivals.append(Arrival(step, prompt, total - prompt_len, n, draw(st.integers(-2, 2))))
    kinds = st.sampled_from(["waiting", "running", "finished", "unknown"])
    aborts = draw(st.lists(st.tuples(st.integers(0, 20), kinds, st.integers(0, 1000)), max_size=4))
    duplicates = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 1000)), max_size=1))
    scheduling_policy = draw(st.sampled_from(["fcfs", "priority"]))
    if scheduling_policy == "fcfs":
        arrivals = [dataclasses.replace(a, priority=0) for a in arrivals]
    window = None
    if draw(st.integers(0, 2)) == 0:
        # Sliding-window layers: a pool as small as one request's sight and step allow (as the runner's
        # sizing guarantees), or a little more, so that requests crowd it too.
        tokens = draw(st.integers(1, 24))
        alone = min(num_blocks, blocks_for(tokens, block_size) + 2 + blocks_for(budget, block_size))
        window = SlidingWindow(tokens, alone + 1 + draw(st.integers(0, 4)))
    return Scenario(policy, chunked, block_size, num_blocks, max_num_seqs, budget, max_model_len, arrivals,
                    prefix_caching, aborts, duplicates, scheduling_policy, window)


def note_events(*names: str) -> None:
    """Coverage counters for `pytest --hypothesis-show-statistics`; a no-op outside hypothesis."""
    try:
        for name in names:
            event(name)
    except InvalidArgument:
        pass


def fits(sc: Scenario, a: Arrival) -> bool:
    total = len(a.prompt) + a.max_tokens
    return (
        total <= sc.max_model_len
        and blocks_for(total, sc.block_size) <= sc.num_blocks
        and (sc.chunked or total <= sc.budget)
        and a.n <= sc.max_num_seqs
    )


def run_scenario(sc: Scenario) -> None:
    engine, runner = make_engine(
        sc.policy, block_size=sc.block_size, num_blocks=sc.num_blocks, max_num_seqs=sc.max_num_seqs,
        budget=sc.budget, chunked=sc.chunked, max_model_len=sc.max_model_len, prefix_caching=sc.prefix_caching,
        scheduling_policy=sc.scheduling_policy, window=sc.window,
    )
    cfg = engine.config.scheduler
    accepted: dict[str, Request] = {}  # by the id the caller knows: the first sample of each request
    samples: dict[str, Request] = {}  # every sample, forks of n > 1 included
    arrival_of: dict[str, Arrival] = {}
    aborted: set[str] = set()
    aborted_samples: set[str] = set()
    streamed: dict[tuple[str, int], list[RequestOutput]] = defaultdict(list)
    first_admitted: dict[str, None] = {}  # ordered set
    by_step: dict[int, list[Arrival]] = defaultdict(list)
    for a in sc.arrivals:
        by_step[a.step].append(a)
    aborts_at: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for step, kind, pick in sc.aborts:
        aborts_at[step].append((kind, pick))
    dups_at = defaultdict(list)
    for step, pick in sc.duplicates:
        dups_at[step].append(pick)
    last_event = max([a.step for a in sc.arrivals] + [s for s, _, _ in sc.aborts] + [s for s, _ in sc.duplicates])

    def live() -> list[str]:
        return [rid for rid, r in accepted.items() if not r.is_finished]

    step = 0
    while step <= last_event or engine.has_unfinished_requests:
        assert step < 20_000, "the engine stopped making progress"
        for a in by_step[step]:
            params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, n=a.n, priority=a.priority)
            before = engine_state(engine)
            if fits(sc, a):
                rid = engine.add_request(a.prompt, params)
                accepted[rid] = samples[rid] = engine.scheduler.requests[rid]
                arrival_of[rid] = a
                assert accepted[rid].status is RequestStatus.WAITING
            else:
                total = len(a.prompt) + a.max_tokens
                note_events(*[f"rejected for {why}" for why, over in [
                    ("max_model_len", total > sc.max_model_len),
                    ("pool", blocks_for(total, sc.block_size) > sc.num_blocks),
                    ("budget", not sc.chunked and total > sc.budget),
                    ("n", a.n > sc.max_num_seqs),
                ] if over])
                with pytest.raises(InvalidRequestError):
                    engine.add_request(a.prompt, params)
                assert engine_state(engine) == before, "a rejected request changed the engine"
        for pick in dups_at[step]:
            ids = live()
            if ids:
                before = engine_state(engine)
                with pytest.raises(InvalidRequestError, match="already in use"):
                    engine.add_request([1, 2], SamplingParams(max_tokens=1), request_id=ids[pick % len(ids)])
                assert engine_state(engine) == before
        for kind, pick in aborts_at[step]:
            if kind == "waiting":
                pool = [rid for rid in live() if accepted[rid].status is RequestStatus.WAITING]
            elif kind == "running":
                pool = [rid for rid in live() if accepted[rid].status is RequestStatus.RUNNING]
            elif kind == "finished":
                pool = [rid for rid, r in accepted.items() if r.is_finished]
            else:
                pool = [f"no-such-request-{pick}"]
            if not pool:
                continue
            rid = pool[pick % len(pool)]
            unfinished = [r for r in samples.values() if r.group_id == rid and not r.is_finished]
            expected = rid in accepted and bool(unfinished)  # a finished sample's siblings may still run
            free_before = engine.scheduler.kv.num_free_blocks
            assert engine.abort_request(rid) is expected
            if expected:
                aborted.add(rid)
                aborted_samples.update(r.request_id for r in unfinished)
                for r in unfinished:
                        assert r.status is RequestStatus.FINISHED_ABORTED
                        assert r.times.finished is not None
                        assert r.request_id not in engine.scheduler.kv.block_tables
                assert engine.scheduler.kv.num_free_blocks >= free_before
        check_blocks(engine)
        check_requests(engine, cfg, samples)

        had_work = engine.has_unfinished_requests
        before_waiting = list(engine.scheduler.waiting)
        before_members = members(engine)
        before_all_finished = all(m.is_finished for m in before_members)
        before_holding = set(engine.scheduler.kv.block_tables)
        before_seats = sum(1 + r.pending_forks for r in before_members)  # n > 1 holds n seats from admission
        n_steps = len(runner.steps)
        outputs = engine.step()
        if had_work:
            assert len(runner.steps) == n_steps + 1, "unfinished requests but nothing scheduled"
        else:
            assert outputs == [] and len(runner.steps) == n_steps
        check_decision(
            engine, runner, cfg, before_waiting, before_members, before_all_finished, before_holding, n_steps,
            before_seats,
        )
        if len(runner.steps) > n_steps:
            if isinstance(engine.scheduler, ContinuousScheduler):
                joined = [r for r, _ in runner.steps[-1].scheduled]
            else:
                joined = members(engine)
            for r in joined:
                if r.request_id not in first_admitted:
                    first_admitted[r.request_id] = None
        for _, r in runner.steps[-1].forks if len(runner.steps) > n_steps else []:  # samples branched off
            if r.request_id not in samples:
                samples[r.request_id] = r
                arrival_of[r.request_id] = arrival_of[r.group_id]
        for o in outputs:
            assert o.request_id in accepted and o.request_id not in aborted
            key = (o.request_id, o.index)
            assert not streamed[key] or not streamed[key][-1].finished
            assert len(o.new_token_ids) == 1
            streamed[key].append(o)
        check_blocks(engine)
        check_requests(engine, cfg, samples)
        step += 1

    note_events(
        f"policy={sc.policy} chunked={sc.chunked} scheduling={sc.scheduling_policy}",
        f"preempted={'yes' if engine.scheduler.num_preemptions else 'no'}",
        f"rejected={'yes' if len(accepted) < len(sc.arrivals) else 'no'}",
        f"aborted={'yes' if aborted else 'no'}",
        f"split prefill={'yes' if runner.split_prefill else 'no'}",
        f"prefix hit={'yes' if engine.scheduler.prefix_cache_hits else 'no'}",
        f"n>1={'yes' if len(samples) > len(accepted) else 'no'}",
        f"window pool={'yes, dropped' if runner.window_dropped else 'yes' if sc.window is not None else 'no'}",
        f"window hit={'yes' if sc.window is not None and engine.scheduler.prefix_cache_hits else 'no'}",
    )

    # FCFS over the whole run: first admissions (continuous) or batch membership (static) follow the
    # order in which requests were added; only preempted requests may jump the queue. (By priority,
    # each step's admissions are the head of a queue kept in priority order: checked per step.)
    if sc.scheduling_policy == "fcfs":
        add_index = {rid: i for i, rid in enumerate(accepted)}
        order = [add_index[rid] for rid in first_admitted if rid in add_index]
        assert order == sorted(order), "requests were admitted out of arrival order"

    # --- the end state ----------------------------------------------------------------------------
    kv, s = engine.scheduler.kv, engine.scheduler
    assert kv.num_free_blocks == kv.num_blocks and kv.block_tables == {} and kv.num_slotted_tokens == {}
    assert kv.pool.num_free == kv.pool.num_blocks and kv.usage().used_blocks == 0, "every block back in the pool"
    assert kv._keys == {} and kv._num_offered == {}
    assert kv.window_tables == {} and kv._num_dropped == {}
    if kv.window_pool is not None:
        assert kv.window_pool.num_free == kv.window_pool.num_blocks - 1, "every window block back in its pool"
    assert s.prefix_cache_hits <= s.prefix_cache_queries
    assert s.requests == {} and not s.waiting and s.num_running == 0
    if isinstance(s, ContinuousScheduler):
        assert s.running == []
    assert s.num_preemptions == sum(r.num_preemptions for r in samples.values())
    assert all(len([r for r in samples.values() if r.group_id == rid]) == arrival_of[rid].n
               for rid in accepted if rid not in aborted)
    for rid, r in samples.items():
        a = arrival_of[rid]
        outs = streamed[(r.group_id, r.sample_index)]
        assert [t for o in outs for t in o.new_token_ids] == r.output_token_ids
        if outs:
            assert all(o.num_cached_tokens == (r.num_cached_tokens or 0) for o in outs)
        if rid in aborted_samples:
            assert r.status is RequestStatus.FINISHED_ABORTED and r.status.value == "abort"
            assert len(r.output_token_ids) < a.max_tokens
            assert not outs or not outs[-1].finished
            assert list(solo(tuple(a.prompt), a.max_tokens))[: len(r.output_token_ids)] == r.output_token_ids
            continue
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert len(r.output_token_ids) == a.max_tokens
        assert r.output_token_ids == list(solo(tuple(a.prompt), a.max_tokens)), "batching changed the tokens"
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert outs[-1].num_preemptions == r.num_preemptions
        assert not any(o.finished for o in outs[:-1])
        t = r.times
        assert t.arrival <= t.first_scheduled <= t.first_token <= t.tokens[0]
        assert t.tokens == sorted(t.tokens) and t.tokens[-1] <= t.finished
        assert len(t.tokens) == a.max_tokens


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_random_workloads_keep_every_invariant(sc: Scenario) -> None:
    run_scenario(sc)


# --- targeted: pools so small that preemption is the normal case ---------------------------------
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios(pressure=True))
def test_tiny_pools_preempt_and_still_agree(sc: Scenario) -> None:
    run_scenario(sc)


def test_a_tiny_pool_really_preempts() -> None:
    sc = Scenario("continuous", True, 2, 4, 4, 64, 64,
                  [Arrival(0, [5, 6, 7], 5), Arrival(0, [8, 9, 10], 5), Arrival(0, [1], 3)])
    run_scenario(sc)
    engine, _ = make_engine(block_size=2, num_blocks=4, max_num_seqs=4, budget=64)
    for a in sc.arrivals:
        engine.add_request(a.prompt, SamplingParams(max_tokens=a.max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests:
        engine.step()
    assert engine.scheduler.num_preemptions > 0


# --- the schedulers on their own --------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(["continuous", "static"]),
    chunked=st.booleans(),
    budget=st.integers(1, 20),
    max_num_seqs=st.integers(1, 5),
    prompts=st.lists(st.integers(1, 20), min_size=1, max_size=8),
)
def test_scheduler_alone_drains_a_queue(policy, chunked, budget, max_num_seqs, prompts) -> None:  # noqa: ANN001
    """Driving schedule()/update_from_output() by hand, finishing each request after one token."""
    kv = KVCacheManager(64, 4)
    sched = make_scheduler(SchedulerConfig(policy, max_num_seqs, budget, chunked), kv)
    reqs = []
    for i, p in enumerate(prompts):
        if not chunked and p + 1 > budget:
            continue  # the engine would reject it
        r = Request(str(i), list(range(p)), SamplingParams(max_tokens=1), arrival_time=0.0)
        sched.add_request(r)
        reqs.append(r)
    for _ in range(1000):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        assert not out.is_empty
        assert out.num_tokens <= budget and len(out.scheduled) <= max_num_seqs
        done = out.sampling_requests()
        for r in done:
            r.output_token_ids.append(0)
        sched.update_from_output(out, [(r, RequestStatus.FINISHED_LENGTH) for r in done])
    assert not sched.has_unfinished
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert kv.num_free_blocks == 64 and kv.block_tables == {}
