"""Property tests for speculative decoding on the scheduler and KV manager: random proposals (a
random-length run of right tokens, then wrong ones), under random pools, budgets, chunking, prefix
caching, n > 1 and preemption. The runner (test_properties.PagedRunner) writes into each slot what a
forward would (a function of the whole sequence up to it) and reads the computed prefix back, so a
rolled-back slot that was not rewritten, or a rejected token reaching the cache, would change the
outputs; each request must end with exactly the tokens it gets alone without speculation."""
from __future__ import annotations

import random
from collections import defaultdict
from typing import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.request import Request, RequestStatus
from conveyor.sampling.outputs import SamplerOutput, verify_rows
from conveyor.sampling.params import SamplingParams
from tests.scheduler.test_properties import (
    VOCAB, PagedRunner, Scenario, check_blocks, check_requests, fits, prefix_hashes, scenarios, solo,
)


def next_token(sequence: Sequence[int]) -> int:
    """What PagedRunner samples after `sequence`."""
    return prefix_hashes(list(sequence))[-1] % VOCAB


class SpeculatingRunner(PagedRunner):
    supports_speculation = True

    def execute(self, out, stats):  # noqa: ANN001, ANN201 - Runner protocol
        super().execute(out, stats)  # writes every scheduled slot, speculative ones included
        kv = self.kv
        assert kv is not None
        bs = kv.block_size
        rows = []
        for request in out.sampling_requests():
            table = kv.block_tables[request.request_id]
            for pos in range(request.num_tokens - 1, request.num_known_tokens):
                rows.append(self.slots[table[pos // bs] * bs + pos % bs][1] % VOCAB)
        tokens, accepted = verify_rows(rows, [r.spec_token_ids for r in out.sampling_requests()])
        self.num_accepted += sum(accepted)
        self.num_rejected += sum(len(r.spec_token_ids) for r in out.sampling_requests()) - sum(accepted)
        return SamplerOutput(tokens, num_accepted=accepted)

    num_accepted = 0
    num_rejected = 0


class RandomProposer:
    """A random number of right tokens, then wrong ones (each run of them a random length)."""

    cost_per_token = 0.0

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)

    def propose(self, requests: Sequence[Request], depths: Sequence[int]) -> list[list[int]]:
        proposals = []
        for request, depth in zip(requests, depths):
            sequence = request.prompt_token_ids + request.output_token_ids
            right = self.random.randint(0, depth)
            proposal: list[int] = []
            for i in range(self.random.randint(0, depth)):
                proposal.append(next_token(sequence + proposal) if i < right else self.random.randrange(VOCAB))
            proposals.append(proposal)
        return proposals


def run(sc: Scenario, depth: int, seed: int) -> SpeculatingRunner:
    runner = SpeculatingRunner()
    runner.block_size = sc.block_size
    runner.kv_window = sc.window
    config = EngineConfig(
        block_size=sc.block_size, enable_prefix_caching=sc.prefix_caching,
        speculative_config=SpeculativeConfig(num_speculative_tokens=depth, adaptive=False),
        scheduler=SchedulerConfig(policy=sc.policy, max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.budget,
                                  chunked_prefill=sc.chunked))
    ticks = iter(range(10**9))
    engine = LLMEngine(config, runner, num_kv_blocks=sc.num_blocks, max_model_len=sc.max_model_len,
                       vocab_size=VOCAB, clock=lambda: float(next(ticks)), proposer=RandomProposer(seed))
    runner.kv = engine.scheduler.kv
    by_step: dict[int, list] = defaultdict(list)
    for a in sc.arrivals:
        if fits(sc, a):
            by_step[a.step].append(a)
    samples: dict[str, Request] = {}
    expected: dict[str, tuple[int, ...]] = {}
    last = max((a.step for a in sc.arrivals), default=0)
    step = 0
    while step <= last or engine.has_unfinished_requests:
        assert step < 20_000, "the engine stopped making progress"
        for a in by_step[step]:
            rid = engine.add_request(a.prompt, SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, n=a.n))
            samples[rid] = engine.scheduler.requests[rid]
            expected[rid] = solo(tuple(a.prompt), a.max_tokens)
        engine.step()
        for request in list(engine.scheduler.requests.values()):
            samples.setdefault(request.request_id, request)
            expected.setdefault(request.request_id, expected[request.group_id])
            # Proposals never reach past max_tokens; none is held by a request that is not decoding.
            assert len(request.output_token_ids) + len(request.spec_token_ids) < request.sampling_params.max_tokens \
                or not request.spec_token_ids
            if request.spec_token_ids:
                assert request.num_computed_tokens == request.num_tokens - 1
        check_blocks(engine)
        check_requests(engine, engine.config.scheduler, samples)
        step += 1
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.block_tables, "every block back when all requests end"
    assert kv.window_pool is None or kv.window_pool.num_free == kv.window_pool.num_blocks - 1
    for rid, request in samples.items():
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert tuple(request.output_token_ids) == expected[rid], f"{rid} changed by speculation"
    return runner


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sc=scenarios(), depth=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_random_proposals_change_no_output_and_leak_no_block(sc: Scenario, depth: int, seed: int) -> None:
    run(sc, depth, seed)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sc=scenarios(pressure=True), depth=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_under_preemption_too(sc: Scenario, depth: int, seed: int) -> None:
    run(sc, depth, seed)


def test_proposals_are_accepted_and_rejected_in_these_runs() -> None:
    """The properties above are not vacuous: the same machinery accepts and rejects tokens."""
    sc = Scenario("continuous", True, 4, 64, 4, 32, 256, [])
    from tests.scheduler.test_properties import Arrival

    sc.arrivals = [Arrival(0, [5, 6, 7, 8, 9], 60), Arrival(1, list(range(40, 60)), 50, n=2)]
    runner = run(sc, 5, seed=3)
    assert runner.num_accepted > 20 and runner.num_rejected > 20
