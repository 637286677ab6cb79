"""BlockPool: free list + ref counts, O(1) allocate/free, sharing, and misuse detection."""
from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conveyor.kv import BlockPool, OutOfBlocksError


def check_pool(pool: BlockPool) -> None:
    """The free list holds distinct blocks, exactly those whose ref count is 0."""
    free = list(pool._free)
    assert len(free) == len(set(free)) == pool.num_free
    assert pool.num_free + pool.num_used == pool.num_blocks
    for b in range(pool.num_blocks):
        assert pool.ref_count(b) >= 0
        assert (pool.ref_count(b) == 0) == (b in set(free))


# --- construction -------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, -1])
def test_needs_at_least_one_block(n: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(n)


def test_fresh_pool_is_all_free() -> None:
    pool = BlockPool(5)
    assert pool.num_blocks == 5 and pool.num_free == 5 and pool.num_used == 0
    assert all(pool.ref_count(b) == 0 for b in range(5))
    check_pool(pool)


# --- allocate / free ----------------------------------------------------------------------------
def test_allocate_hands_out_distinct_blocks_with_ref_one() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert len(a) == 2 and len(b) == 3
    assert len(set(a) | set(b)) == 5
    assert all(pool.ref_count(x) == 1 for x in a + b)
    assert pool.num_free == 1 and pool.num_used == 5
    check_pool(pool)


def test_allocate_zero_is_a_no_op() -> None:
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.num_free == 3
    check_pool(pool)


def test_allocate_all_then_out_of_blocks_leaves_state_unchanged() -> None:
    pool = BlockPool(4)
    held = pool.allocate(3)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1
    assert all(pool.ref_count(b) == 1 for b in held)
    check_pool(pool)
    last = pool.allocate(1)
    assert pool.num_free == 0
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    pool.free(held + last)
    assert pool.num_free == 4
    check_pool(pool)


def test_free_returns_blocks_and_they_are_reused() -> None:
    pool = BlockPool(3)
    a = pool.allocate(3)
    pool.free(a[:2])
    assert pool.num_free == 2
    assert all(pool.ref_count(b) == 0 for b in a[:2]) and pool.ref_count(a[2]) == 1
    again = pool.allocate(2)
    assert set(again) == set(a[:2])
    check_pool(pool)


def test_blocks_are_freed_in_reverse_order() -> None:
    # The tail of a sequence goes back first, so its cached head is evicted last.
    pool = BlockPool(4)
    table = pool.allocate(4)
    assert table == [0, 1, 2, 3]
    for block in table:
        pool.cache(block, bytes([block]))
    pool.free(table)
    assert pool.allocate(4) == [3, 2, 1, 0]


def test_plain_blocks_go_out_most_recently_freed_first_then_never_used_ones() -> None:
    # A block's memory is mapped when first written: reuse keeps to the blocks written already.
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    pool.free([a[0]])
    pool.free([a[2]])
    assert pool.allocate(4) == [2, 0, 3, 4]


def test_double_free_raises() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.free(a)
    with pytest.raises(ValueError):
        pool.free([a[0]])
    with pytest.raises(ValueError):
        pool.free([a[1]])
    assert pool.num_free == 3
    check_pool(pool)


def test_freeing_a_never_allocated_block_raises() -> None:
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.free([1])
    assert pool.num_free == 3
    check_pool(pool)


def test_duplicate_in_one_free_call_raises() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.free([b, b])


# --- sharing ------------------------------------------------------------------------------------
def test_share_counts_references() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.share(b)
    pool.share(b)
    assert pool.ref_count(b) == 3
    pool.free([b])
    pool.free([b])
    assert pool.ref_count(b) == 1 and pool.num_free == 1  # still owned by the last holder
    check_pool(pool)
    pool.free([b])
    assert pool.ref_count(b) == 0 and pool.num_free == 2
    check_pool(pool)
    with pytest.raises(ValueError):
        pool.free([b])


def test_shared_block_is_not_handed_out_again() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.share(b)
    pool.free([b])
    other = pool.allocate(1)
    assert other != [b]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)


def test_cannot_share_a_free_block() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.share(0)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError):
        pool.share(b)
    check_pool(pool)


# --- O(1) ---------------------------------------------------------------------------------------
def _lines_run_below(work: Callable[[], None]) -> int:
    """How many Python lines the calls `work` makes execute, outside this file (an operation count
    that does not depend on the machine)."""
    count = 0

    def trace(frame: FrameType, event: str, arg: object) -> Callable[..., object] | None:
        nonlocal count
        if frame.f_code.co_filename == __file__:
            return trace if event == "call" else None
        if event == "line":
            count += 1
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        work()
    finally:
        sys.settrace(previous)
    return count


def test_allocate_and_free_do_not_scan_the_pool() -> None:
    # The same calls must run the same code whatever the pool's size: a Python loop over the free
    # list or the ref counts runs more lines on the larger pool (a C-level scan, `in` on the deque,
    # is not seen here).
    def rounds(pool: BlockPool) -> Callable[[], None]:
        def work() -> None:
            for _ in range(20):
                blocks = pool.allocate(3)
                pool.share(blocks[0])
                pool.free(blocks)
                pool.free(blocks[:1])
        return work

    small, large = BlockPool(4), BlockPool(100_000)
    lines_small, lines_large = _lines_run_below(rounds(small)), _lines_run_below(rounds(large))
    assert lines_small > 0
    assert lines_large == lines_small
    assert small.num_free == 4 and large.num_free == 100_000


# --- random use ---------------------------------------------------------------------------------
class PoolMachine(RuleBasedStateMachine):
    """Random allocate/share/free; a model tracks who holds each reference."""

    @initialize(num_blocks=st.integers(1, 12))
    def make(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.refs: list[int] = []  # one entry per reference held (a block may appear several times)

    @rule(n=st.integers(0, 14))
    def allocate(self, n: int) -> None:
        free_before = self.pool.num_free
        if n > free_before:
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate(n)
            assert self.pool.num_free == free_before
            return
        blocks = self.pool.allocate(n)
        assert len(blocks) == len(set(blocks)) == n
        assert not set(blocks) & set(self.refs), "handed out a block that is still referenced"
        self.refs.extend(blocks)

    @precondition(lambda self: self.refs)
    @rule(i=st.integers(0, 10**6))
    def share(self, i: int) -> None:
        b = self.refs[i % len(self.refs)]
        self.pool.share(b)
        self.refs.append(b)

    @precondition(lambda self: self.refs)
    @rule(i=st.integers(0, 10**6), k=st.integers(1, 4))
    def free_some(self, i: int, k: int) -> None:
        # Free up to k distinct held references in one call.
        start = i % len(self.refs)
        chosen: list[int] = []
        for b in self.refs[start:] + self.refs[:start]:
            if b not in chosen:
                chosen.append(b)
            if len(chosen) == k:
                break
        self.pool.free(chosen)
        for b in chosen:
            self.refs.remove(b)

    @rule(b=st.integers(0, 11))
    def double_free_raises(self, b: int) -> None:
        if b < self.pool.num_blocks and b not in self.refs:
            with pytest.raises(ValueError):
                self.pool.free([b])

    @invariant()
    def consistent(self) -> None:
        check_pool(self.pool)
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_count(b) == self.refs.count(b)
        assert self.pool.num_free + len(set(self.refs)) == self.pool.num_blocks


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
