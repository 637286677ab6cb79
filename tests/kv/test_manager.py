"""KVCacheManager: append-only block tables, slot accounting, waste bound, random use."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from conveyor.kv import NULL_BLOCK, KVCacheManager, KVUsage, OutOfBlocksError, SlidingWindow, blocks_for


def check_manager(kv: KVCacheManager, shared: dict[int, int] | None = None) -> None:
    """Conservation, exclusivity and the waste bound. `shared` counts extra references taken
    with pool.share() per block, held outside any table."""
    shared = shared or {}
    pool = kv.pool
    owners: dict[int, list[str]] = {}
    for rid, table in kv.block_tables.items():
        assert len(table) == len(set(table)), f"{rid} holds a block twice"
        for b in table:
            owners.setdefault(b, []).append(rid)
    for b, rids in owners.items():
        assert len(rids) == 1, f"block {b} is in the tables of {rids}"
    held = set(owners) | {b for b, n in shared.items() if n}
    assert pool.num_free + len(held) == kv.num_blocks
    free = set(pool._free)
    assert not free & held
    for b in range(kv.num_blocks):
        assert pool.ref_count(b) == len(owners.get(b, ())) + shared.get(b, 0)
    assert set(kv.num_slotted_tokens) == set(kv.block_tables)
    for rid, table in kv.block_tables.items():
        slotted = kv.num_slotted_tokens[rid]
        assert len(table) == blocks_for(slotted, kv.block_size)
        assert 0 <= len(table) * kv.block_size - slotted < kv.block_size
    usage = kv.usage()
    assert usage.total_blocks == kv.num_blocks
    assert usage.used_blocks == kv.num_blocks - pool.num_free
    assert usage.num_requests == len(kv.block_tables)
    assert 0 <= usage.wasted_slots <= (kv.block_size - 1) * usage.num_requests


# --- blocks_for ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tokens,bs,expected",
    [(0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3), (5, 1, 5), (7, 3, 3)],
)
def test_blocks_for(tokens: int, bs: int, expected: int) -> None:
    assert blocks_for(tokens, bs) == expected


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_blocks_for_is_the_ceiling(tokens: int, bs: int) -> None:
    n = blocks_for(tokens, bs)
    assert n * bs >= tokens
    assert (n - 1) * bs < tokens or n == 0


# --- construction -------------------------------------------------------------------------------
def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError):
        KVCacheManager(0, 4)


def test_fresh_manager() -> None:
    kv = KVCacheManager(8, 4)
    assert kv.num_blocks == 8 and kv.num_free_blocks == 8 and kv.block_size == 4
    assert kv.usage() == KVUsage(used_blocks=0, total_blocks=8, wasted_slots=0, num_requests=0)
    check_manager(kv)


# --- allocate -----------------------------------------------------------------------------------
def test_allocate_grows_append_only() -> None:
    kv = KVCacheManager(10, 4)
    first = kv.allocate("a", 5)
    assert len(first) == 2 and kv.block_tables["a"] == first
    assert kv.num_slotted_tokens["a"] == 5
    assert kv.allocate("a", 8) == []  # the second block has room for 3 more
    assert kv.block_tables["a"] == first
    more = kv.allocate("a", 9)
    assert len(more) == 1
    assert kv.block_tables["a"] == first + more
    assert kv.num_free_blocks == 7
    check_manager(kv)


def test_allocate_never_shrinks() -> None:
    kv = KVCacheManager(10, 4)
    kv.allocate("a", 9)
    table = list(kv.block_tables["a"])
    assert kv.allocate("a", 2) == []
    assert kv.block_tables["a"] == table
    assert kv.num_slotted_tokens["a"] == 9
    check_manager(kv)


def test_can_allocate_counts_new_blocks() -> None:
    kv = KVCacheManager(3, 4)
    assert kv.can_allocate("a", 0) and kv.can_allocate("a", 12) and not kv.can_allocate("a", 13)
    kv.allocate("a", 6)
    assert kv.allocate("a", 7) == []  # the second block has room
    assert len(kv.allocate("a", 9)) == 1
    assert kv.allocate("a", 3) == []  # never shrinks
    assert kv.can_allocate("b", 0) and not kv.can_allocate("b", 1)
    assert kv.can_allocate("a", 12) and not kv.can_allocate("a", 13)


def test_requests_get_disjoint_tables() -> None:
    kv = KVCacheManager(6, 2)
    kv.allocate("a", 3)
    kv.allocate("b", 4)
    kv.allocate("a", 4)
    kv.allocate("c", 1)
    assert not set(kv.block_tables["a"]) & set(kv.block_tables["b"])
    check_manager(kv)


def test_out_of_blocks_raises_and_leaves_state_unchanged() -> None:
    kv = KVCacheManager(3, 4)
    kv.allocate("a", 8)
    before = ({k: list(v) for k, v in kv.block_tables.items()}, dict(kv.num_slotted_tokens), kv.num_free_blocks)
    assert not kv.can_allocate("b", 5)
    with pytest.raises(OutOfBlocksError):
        kv.allocate("b", 5)  # a new request
    with pytest.raises(OutOfBlocksError):
        kv.allocate("a", 13)  # growing an existing one
    after = ({k: list(v) for k, v in kv.block_tables.items()}, dict(kv.num_slotted_tokens), kv.num_free_blocks)
    assert after == before
    assert kv.usage().num_requests == 1
    check_manager(kv)


def test_free_returns_every_block_and_forgets_the_request() -> None:
    kv = KVCacheManager(5, 3)
    kv.allocate("a", 7)
    kv.allocate("b", 2)
    kv.free("a")
    assert "a" not in kv.block_tables and "a" not in kv.num_slotted_tokens
    assert kv.num_free_blocks == 4
    kv.free("a")  # freeing an unknown / already freed request is a no-op
    kv.free("never")
    assert kv.num_free_blocks == 4
    kv.free("b")
    assert kv.num_free_blocks == 5 and kv.block_tables == {}
    check_manager(kv)


def test_freed_request_starts_a_fresh_table() -> None:
    kv = KVCacheManager(4, 2)
    kv.allocate("a", 4)
    kv.free("a")
    kv.allocate("a", 1)
    assert len(kv.block_tables["a"]) == 1 and kv.num_slotted_tokens["a"] == 1
    check_manager(kv)


def test_usage_counts_waste_below_one_block_per_request() -> None:
    kv = KVCacheManager(20, 8)
    kv.allocate("a", 1)  # 7 wasted
    kv.allocate("b", 8)  # 0 wasted
    kv.allocate("c", 17)  # 7 wasted
    usage = kv.usage()
    assert usage.used_blocks == 1 + 1 + 3
    assert usage.wasted_slots == 14
    assert usage.num_requests == 3
    assert usage.usage == pytest.approx(5 / 20)
    check_manager(kv)


def test_shared_block_survives_its_table_owner() -> None:
    kv = KVCacheManager(3, 2)
    kv.allocate("a", 4)
    head = kv.block_tables["a"][0]
    kv.pool.share(head)
    check_manager(kv, {head: 1})
    kv.free("a")
    assert kv.num_free_blocks == 2 and kv.pool.ref_count(head) == 1
    check_manager(kv, {head: 1})
    kv.allocate("b", 4)
    assert head not in kv.block_tables["b"]
    check_manager(kv, {head: 1})
    kv.pool.free([head])
    check_manager(kv)
    assert kv.num_free_blocks == 1


# --- random allocate / grow / free / share ---------------------------------------------------------
class ManagerMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(num_blocks=st.integers(1, 16), block_size=st.integers(1, 5))
    def make(self, num_blocks: int, block_size: int) -> None:
        self.kv = KVCacheManager(num_blocks, block_size)
        self.tokens: dict[str, int] = {}  # model: slotted tokens per live request
        self.shared: dict[int, int] = {}  # extra references taken with pool.share()
        self.next_id = 0

    def _snapshot(self) -> tuple:
        return (
            {k: list(v) for k, v in self.kv.block_tables.items()},
            dict(self.kv.num_slotted_tokens),
            self.kv.num_free_blocks,
            list(self.kv.pool._free),
        )

    @rule(target=requests, n=st.integers(0, 40))
    def new_request(self, n: int) -> str:
        rid = f"r{self.next_id}"
        self.next_id += 1
        need = blocks_for(n, self.kv.block_size)
        if need > self.kv.num_free_blocks:
            assert not self.kv.can_allocate(rid, n)
            before = self._snapshot()
            with pytest.raises(OutOfBlocksError):
                self.kv.allocate(rid, n)
            assert self._snapshot() == before
            return rid  # never got a table; later rules treat it as unknown
        assert self.kv.can_allocate(rid, n)
        new = self.kv.allocate(rid, n)
        assert len(new) == need
        self.tokens[rid] = n
        return rid

    @rule(rid=requests, k=st.integers(0, 12))
    def grow(self, rid: str, k: int) -> None:
        if rid not in self.tokens:
            return
        old_table = list(self.kv.block_tables[rid])
        total = self.tokens[rid] + k
        need = blocks_for(total, self.kv.block_size) - len(old_table)
        bs, written = self.kv.block_size, self.tokens[rid]
        # Writing into a partly filled block that someone else also holds copies it first.
        cow = k > 0 and written % bs != 0 and self.kv.pool.ref_count(old_table[written // bs]) > 1
        if need + cow > self.kv.num_free_blocks:
            assert not self.kv.can_allocate(rid, total)
            before = self._snapshot()
            with pytest.raises(OutOfBlocksError):
                self.kv.allocate(rid, total)
            assert self._snapshot() == before
            return
        new = self.kv.allocate(rid, total)
        assert len(new) == need
        copies = self.kv.take_copies()
        if cow:
            tail = written // bs
            (src, dst), = copies
            assert src == old_table[tail] and dst not in old_table and dst not in new
            old_table[tail] = dst
            assert self.kv.pool.ref_count(dst) == 1
        else:
            assert copies == []
        assert self.kv.block_tables[rid] == old_table + new, "tables are append-only (but for copy-on-write)"
        self.tokens[rid] = total

    @rule(rid=requests, k=st.integers(0, 12))
    def shrink_request_is_ignored(self, rid: str, k: int) -> None:
        if rid not in self.tokens:
            return
        table = list(self.kv.block_tables[rid])
        assert self.kv.allocate(rid, max(0, self.tokens[rid] - k)) == []
        assert self.kv.block_tables[rid] == table
        assert self.kv.num_slotted_tokens[rid] == self.tokens[rid]

    @rule(rid=consumes(requests))
    def free(self, rid: str) -> None:
        free_before = self.kv.num_free_blocks
        table = list(self.kv.block_tables.get(rid, []))
        self.kv.free(rid)
        returned = [b for b in table if self.kv.pool.ref_count(b) == 0]
        assert self.kv.num_free_blocks == free_before + len(returned)
        assert len(returned) == len([b for b in table if not self.shared.get(b)])
        self.tokens.pop(rid, None)
        assert rid not in self.kv.block_tables

    @precondition(lambda self: any(self.kv.block_tables.values()))
    @rule(i=st.integers(0, 10**6))
    def share(self, i: int) -> None:
        owned = sorted(b for t in self.kv.block_tables.values() for b in t)
        b = owned[i % len(owned)]
        self.kv.pool.share(b)
        self.shared[b] = self.shared.get(b, 0) + 1

    @precondition(lambda self: any(self.shared.values()))
    @rule(i=st.integers(0, 10**6))
    def unshare(self, i: int) -> None:
        held = sorted(b for b, n in self.shared.items() if n)
        b = held[i % len(held)]
        self.kv.pool.free([b])
        self.shared[b] -= 1

    @invariant()
    def consistent(self) -> None:
        check_manager(self.kv, self.shared)
        assert self.kv.num_slotted_tokens == {r: n for r, n in self.tokens.items()}


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# --- sliding-window layers' pool ------------------------------------------------------------------
def test_a_window_table_gives_back_what_no_query_sees() -> None:
    """Window 5 over blocks of 4: the next query at position p sees p - 4 .. p, so once 12 tokens are
    computed (next query at 12, first visible 8) blocks 0 and 1 go back to the window pool, while
    the main table keeps them all."""
    kv = KVCacheManager(16, 4, sliding_window=SlidingWindow(5, 8))
    assert kv.window_pool is not None and kv.usage().window_total_blocks == 7  # NULL_BLOCK never counted
    kv.allocate("a", 12)
    assert len(kv.window_tables["a"]) == 3 and NULL_BLOCK not in kv.window_tables["a"]
    assert kv.usage().window_used_blocks == 3
    kv.allocate("a", 13)  # one token more: the query at 12 sees 8..12
    assert kv.window_tables["a"][:2] == [NULL_BLOCK, NULL_BLOCK] and NULL_BLOCK not in kv.window_tables["a"][2:]
    assert len(kv.block_tables["a"]) == len(kv.window_tables["a"]) == 4
    assert kv.usage().window_used_blocks == 2 and kv.usage().used_blocks == 4
    kv.truncate("a", 12)  # a rejected speculative token: its block goes back from both tables
    assert len(kv.window_tables["a"]) == 3 and kv.usage().window_used_blocks == 1
    kv.free("a")
    assert kv.usage().window_used_blocks == 0 and kv.window_tables == {}


def test_the_window_pool_bounds_what_a_request_may_take() -> None:
    """A step's tokens need window slots too: 3 usable window blocks hold a 12-token chunk, not 13."""
    kv = KVCacheManager(16, 4, sliding_window=SlidingWindow(5, 4))
    assert kv.can_allocate("a", 12) and not kv.can_allocate("a", 13)
    with pytest.raises(OutOfBlocksError):
        kv.allocate("a", 13)
    assert kv.block_tables == {} and kv.window_tables == {}, "a refused allocation leaves nothing behind"
    kv.allocate("a", 12)
    assert kv.can_allocate("a", 16), "the blocks it gives back make room for its next ones"


def test_a_prefix_hit_reaches_only_as_far_as_the_window_pool_holds() -> None:
    from conveyor.kv.keys import SequenceKey

    tokens = list(range(40))

    def key(rid: str) -> SequenceKey:
        return SequenceKey(rid, lambda start, end: tokens[start:end])

    kv = KVCacheManager(32, 4, enable_prefix_caching=True, sliding_window=SlidingWindow(5, 12))
    kv.allocate("a", 32)
    kv.cache_full_blocks(key("a"), 32)
    kv.allocate("a", 33)  # blocks 0..5 leave its window table (keyed: evictable in the window pool)
    kv.free("a")
    hit = kv.cached_prefix(key("b"), 32)
    assert len(hit) == 8
    kv.allocate("b", 33, hit)
    assert kv.window_tables["b"][:6] == [NULL_BLOCK] * 6  # out of the next query's sight: not taken
    kv.free("b")
    window_pool = kv.window_pool
    assert window_pool is not None
    window_pool.allocate(window_pool.num_free)  # evicts every cached window block
    assert kv.cached_prefix(key("c"), 32) == [], "the main pool's blocks alone are no hit"


def test_an_import_longer_than_the_window_pool_takes_only_what_it_keeps() -> None:
    """A 100-token import into a 12-block window pool (window 5, blocks of 4): its window table starts
    a window before its next query's sight (entry 22 of 26), so it takes 4 blocks, not 26."""
    kv = KVCacheManager(64, 4, sliding_window=SlidingWindow(5, 12))
    start = kv.import_window_start(100, window_held_from=0)
    assert start == kv.first_visible_block(100) - blocks_for(5, 4) == 22
    assert kv.window_blocks_to_start(101, (), start) == 26 - 22
    kv.allocate("imported", 100, (), start)
    assert kv.window_tables["imported"] == [NULL_BLOCK] * 22 + kv.window_tables["imported"][22:]
    assert NULL_BLOCK not in kv.window_tables["imported"][22:] and kv.usage().window_used_blocks == 3
    assert kv.import_window_start(100, window_held_from=24) == 24, "nothing the exporter no longer held"
    kv.allocate("imported", 101)  # its first step gives back what it kept before its sight
    assert kv.window_tables["imported"][:24] == [NULL_BLOCK] * 24
    kv.free("imported")
    assert kv.usage().window_used_blocks == 0
