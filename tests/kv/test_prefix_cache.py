"""Prefix caching in the pool and the manager: keys, hits, the evictable LRU list, and a state
machine that checks ref counts and that a hit's block holds exactly the tokens the request has."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from conveyor.kv import BlockPool, KVCacheManager, OutOfBlocksError, SequenceKey, iter_block_keys


def slicer(tokens: list[int]):  # noqa: ANN201
    return lambda start, end: tokens[start:end]


def start(kv: KVCacheManager, rid: str, tokens: list[int], computed: int | None = None) -> int:
    """Admit a request as the scheduler does: take its cached prefix (never its last token), then
    compute up to `computed` tokens (all of them by default) and key the blocks they fill."""
    cached = kv.cached_prefix(SequenceKey(rid, slicer(tokens)), len(tokens) - 1)
    hit = len(cached) * kv.block_size
    total = len(tokens) if computed is None else computed
    kv.allocate(rid, max(total, hit + 1), cached)
    kv.cache_full_blocks(SequenceKey(rid, slicer(tokens)), max(total, hit + 1))
    return hit


# --- the pool ---------------------------------------------------------------------------------------
def test_freed_keyed_blocks_are_evictable_and_plain_blocks_go_first() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert pool.cache(a[0], b"k0") and pool.cache(a[1], b"k1")
    pool.free(a)
    assert pool.num_free == 4 and pool.num_evictable == 2 and pool.num_used == 0
    assert list(pool._evictable) == [a[1], a[0]], "tail first: the head is evicted last"
    assert pool.allocate(2) == [2, 3], "plain free blocks before evictable ones"
    assert pool.lookup(b"k0") == a[0] and pool.lookup(b"k1") == a[1]
    assert pool.allocate(1) == [a[1]]  # the least recently freed: the old tail
    assert pool.lookup(b"k1") is None and pool.key_of(a[1]) is None, "eviction drops the key"
    assert pool.lookup(b"k0") == a[0]


def test_a_hit_takes_the_block_off_the_evictable_list_and_counts_a_reference() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(b, b"k")
    pool.take_cached(b)  # a second owner while the first still holds it
    assert pool.ref_count(b) == 2
    pool.free([b])
    pool.free([b])
    assert pool.num_evictable == 1
    pool.take_cached(b)
    assert pool.ref_count(b) == 1 and pool.num_evictable == 0 and pool.num_free == 2
    with pytest.raises(ValueError):
        pool.take_cached(pool.allocate(1)[0])  # no key: nothing cached to take


def test_same_content_keeps_its_first_block() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"k")
    assert not pool.cache(b, b"k") and pool.key_of(b) is None
    assert not pool.cache(a, b"other"), "a block keeps the key it has"
    pool.free([b])
    assert pool.num_evictable == 0, "an unkeyed block is plain free"
    with pytest.raises(ValueError):
        pool.cache(b, b"x")  # free blocks are not keyed


# --- keys -------------------------------------------------------------------------------------------
def test_keys_chain_the_whole_prefix_and_the_model() -> None:
    a = list(iter_block_keys("m", [1, 2, 3, 4, 5], 2))
    assert len(a) == 2, "only full blocks get a key"
    assert list(iter_block_keys("m", [1, 2, 3, 4], 2)) == a
    assert list(iter_block_keys("m", [9, 2, 3, 4], 2))[1] != a[1], "a block's key depends on its parents"
    assert list(iter_block_keys("other model", [1, 2, 3, 4], 2)) != a


def test_a_different_model_never_hits() -> None:
    tokens = list(range(9))
    one, other = KVCacheManager(8, 2, True, "model-a"), KVCacheManager(8, 2, True, "model-b")
    for kv in (one, other):
        start(kv, "first", tokens)
        kv.free("first")
    assert len(one.cached_prefix(SequenceKey("again", slicer(tokens)), 8)) == 4
    assert other.pool.num_cached == one.pool.num_cached == 4
    # Keys of model a are not in model b's map although the token ids are the same.
    assert not set(other.pool._block_of) & set(one.pool._block_of)


# --- the manager ------------------------------------------------------------------------------------
def test_a_second_request_shares_the_first_ones_full_blocks() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    tokens = list(range(10))
    assert start(kv, "a", tokens) == 0
    a = kv.block_tables["a"]
    assert kv.pool.num_cached == 2  # two full blocks; the third holds 2 tokens
    assert start(kv, "b", tokens) == 8
    b = kv.block_tables["b"]
    assert b[:2] == a[:2] and b[2] != a[2]
    assert [kv.pool.ref_count(x) for x in a[:2]] == [2, 2]
    assert kv.num_slotted_tokens["b"] == 10
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8 and kv.usage().used_blocks == 0 and kv.usage().evictable_blocks == 2


def test_the_last_token_is_never_a_hit() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    tokens = list(range(8))
    start(kv, "a", tokens)
    assert kv.pool.num_cached == 2
    # Both blocks are cached, but the last token must be computed for its logits: one block hits.
    assert len(kv.cached_prefix(SequenceKey("b", slicer(tokens)), len(tokens) - 1)) == 1
    assert len(kv.cached_prefix(SequenceKey("c", slicer(tokens + [99])), len(tokens))) == 2


def test_a_hit_needs_free_blocks_only_for_evictable_ones() -> None:
    kv = KVCacheManager(4, 2, enable_prefix_caching=True)
    tokens = [5, 6, 7, 8, 9]
    start(kv, "a", tokens)  # 3 blocks, 2 keyed
    kv.free("a")
    assert kv.num_free_blocks == 4
    cached = kv.cached_prefix(SequenceKey("b", slicer(tokens)), 4)
    assert len(cached) == 2
    assert kv.can_allocate("b", 8, cached)  # 2 evictable taken back + 2 new = 4
    assert not kv.can_allocate("b", 9, cached)
    with pytest.raises(OutOfBlocksError):
        kv.allocate("b", 9, cached)
    assert "b" not in kv.block_tables and kv.pool.num_evictable == 2, "a failed allocate changes nothing"
    kv.allocate("b", 8, cached)
    assert kv.num_free_blocks == 0 and kv.block_tables["b"][:2] == cached
    with pytest.raises(ValueError):
        kv.allocate("b", 8, cached)  # a hit only starts a table


def test_lookup_of_tokens_no_request_holds_finds_the_same_blocks_and_remembers_nothing() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    tokens = list(range(14))
    start(kv, "a", tokens)  # 3 keyed blocks
    unheld = SequenceKey("", slicer(tokens))
    assert kv.lookup_prefix(unheld, 14) == kv.cached_prefix(SequenceKey("b", slicer(tokens)), 14) == kv.block_tables["a"][:3]
    assert kv.lookup_prefix(unheld, 11) == kv.block_tables["a"][:2], "full blocks within max_tokens only"
    assert kv.lookup_prefix(SequenceKey("", slicer([0, 1, 2, 3, 9, 9, 9, 9])), 8) == kv.block_tables["a"][:1], "stops at a miss"
    kv.free("b")
    kv.lookup_prefix(unheld, 14)
    assert kv._keys.keys() == {"a"}, "an import's lookup leaves no memo behind"
    assert KVCacheManager(8, 4).lookup_prefix(unheld, 14) == []


def test_a_cache_salt_keeps_its_requests_blocks_apart() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    tokens = list(range(13))
    cached = kv.cached_prefix(SequenceKey("a", slicer(tokens), "tenant-a"), 12)
    kv.allocate("a", 13, cached)
    kv.cache_full_blocks(SequenceKey("a", slicer(tokens), "tenant-a"), 13)
    assert kv.cached_prefix(SequenceKey("b", slicer(tokens), "tenant-b"), 12) == []
    assert kv.cached_prefix(SequenceKey("c", slicer(tokens)), 12) == [], "no salt is a salt of its own"
    assert kv.cached_prefix(SequenceKey("d", slicer(tokens), "tenant-a"), 12) == kv.block_tables["a"][:3]
    assert kv.lookup_prefix(SequenceKey("", slicer(tokens), "tenant-a"), 12) == kv.block_tables["a"][:3]
    unsalted = kv.lookup_prefix(SequenceKey("", slicer(tokens)), 12)
    assert kv.lookup_prefix(SequenceKey("", slicer(tokens), "tenant-b"), 12) == unsalted == []
    assert list(iter_block_keys("m", tokens, 4, "s")) != list(iter_block_keys("m", tokens, 4))


def test_a_new_table_takes_free_blocks_for_evictable_hits_and_the_blocks_past_them() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    tokens = list(range(12))
    start(kv, "a", tokens)  # 3 keyed blocks, owned
    hits = kv.lookup_prefix(SequenceKey("", slicer(tokens)), 12)
    assert kv.blocks_to_start(13, hits) == 1, "owned hits cost nothing; the 13th token a new block"
    assert kv.blocks_to_start(8, hits) == 0
    kv.free("a")
    assert kv.blocks_to_start(13, hits) == 4, "evictable hits cost a free block each"
    assert kv.blocks_to_start(13) == 4


def test_eviction_takes_the_tail_of_the_least_recently_freed_request_first() -> None:
    kv = KVCacheManager(6, 2, enable_prefix_caching=True)
    start(kv, "a", [1, 2, 3, 4, 5, 6])  # 3 keyed blocks
    start(kv, "b", [7, 8, 9, 10, 11, 12])
    a, b = list(kv.block_tables["a"]), list(kv.block_tables["b"])
    kv.free("a")
    kv.free("b")
    assert kv.pool.allocate(4) == [a[2], a[1], a[0], b[2]]
    assert len(kv.cached_prefix(SequenceKey("c", slicer([1, 2, 3, 4, 5, 6, 0])), 6)) == 0
    assert len(kv.cached_prefix(SequenceKey("d", slicer([7, 8, 9, 10, 11, 12, 0])), 6)) == 2


def test_generated_tokens_are_cached_once_their_block_is_full() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    history = [1, 2, 3, 4, 5, 6]
    start(kv, "turn1", history)
    answer = [7, 8, 9]
    for n in range(len(history) + 1, len(history) + len(answer) + 1):  # decode: one token a step
        kv.allocate("turn1", n)
        kv.cache_full_blocks(SequenceKey("turn1", slicer(history + answer)), n)
    kv.free("turn1")
    turn2 = history + answer + [10, 11]
    assert start(kv, "turn2", turn2) == 8, "the answer's full block is a hit"


@pytest.mark.parametrize("generated_apart", [False, True])
def test_generated_tokens_are_keyed_apart_where_prompts_compute_differently(generated_apart: bool) -> None:
    """Where the runner computes prompt tokens on one kernel and generated ones on another, the
    answer's block (its tokens computed as generated) must not serve the next turn, whose prompt
    holds the same tokens (computed as a prompt); its own prompt's blocks still do. Elsewhere the
    answer's block is a hit as before."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, generated_apart=generated_apart)
    history, answer = [1, 2, 3, 4, 5, 6], [7, 8, 9]
    key = SequenceKey("turn1", slicer(history + answer), prompt_tokens=len(history))
    kv.allocate("turn1", len(history))
    kv.cache_full_blocks(key, len(history))
    for n in range(len(history) + 1, len(history) + len(answer) + 1):
        kv.allocate("turn1", n)
        kv.cache_full_blocks(key, n)
    kv.free("turn1")
    turn2 = history + answer + [10, 11]
    hits = kv.cached_prefix(SequenceKey("turn2", slicer(turn2), prompt_tokens=len(turn2)), len(turn2) - 1)
    assert len(hits) == (1 if generated_apart else 2)
    # The same request again (a recompute after preemption) computes its answer as generated: a hit.
    again = kv.cached_prefix(SequenceKey("turn1-again", slicer(history + answer), prompt_tokens=len(history)), 8)
    assert len(again) == 2
    # Keys of whole-prompt blocks do not change with the switch, nor with the prompt's length past them.
    plain = list(SequenceKey("", slicer(turn2)).block_keys("m", 2, 4))
    assert list(SequenceKey("", slicer(turn2), prompt_tokens=8).block_keys("m", 2, 4, True)) == plain
    assert list(SequenceKey("", slicer(turn2), prompt_tokens=7).block_keys("m", 2, 4, True))[0] == plain[0]
    assert list(SequenceKey("", slicer(turn2), prompt_tokens=7).block_keys("m", 2, 4, True))[1] != plain[1]


def test_disabled_caching_never_keys_or_hits() -> None:
    kv = KVCacheManager(8, 2)
    tokens = list(range(7))
    start(kv, "a", tokens)
    kv.free("a")
    assert kv.pool.num_cached == 0 and kv.cached_prefix(SequenceKey("b", slicer(tokens)), 6) == []


def test_forks_share_keys_and_copy_on_write_stays_private() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5, 6]
    start(kv, "p", prompt)
    kv.fork("p", "c")
    kv.allocate("c", 7)  # the child writes into the shared partial tail: a private copy
    (src, dst), = kv.take_copies()
    assert src == kv.block_tables["p"][1] and dst == kv.block_tables["c"][1]
    kv.cache_full_blocks(SequenceKey("c", slicer(prompt + [9])), 7)
    assert kv.pool.key_of(dst) is None, "not full yet"
    kv.allocate("c", 8)
    kv.cache_full_blocks(SequenceKey("c", slicer(prompt + [9, 10])), 8)
    assert kv.pool.key_of(dst) is not None and kv.pool.key_of(src) is None
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == 8 and kv._keys == {} and kv._num_offered == {}


# --- a state machine over requests with shared prefixes ------------------------------------------
class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests draw their tokens from a few shared stems, start with whatever the cache holds,
    compute a few tokens at a time (keying the blocks they fill), fork, and end. The model records,
    for every block, the tokens at each slot when they were computed: a hit must find exactly the
    request's own tokens there."""

    requests = Bundle("requests")

    @initialize(num_blocks=st.integers(2, 16), block_size=st.integers(1, 4))
    def make(self, num_blocks: int, block_size: int) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, model_identity="m")
        self.tokens: dict[str, list[int]] = {}  # live requests' whole token sequences
        self.computed: dict[str, int] = {}
        self.content: dict[int, dict[int, tuple[int, ...]]] = {}  # block -> slot -> prefix ending there
        self.stems = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9], [7] * 12]
        self.next_id = 0
        self.hits = 0

    def _write(self, rid: str, start: int, end: int) -> None:
        bs, table, tokens = self.kv.block_size, self.kv.block_tables[rid], self.tokens[rid]
        for pos in range(start, end):
            block = table[pos // bs]
            assert self.kv.pool.ref_count(block) == 1, "writing into a shared block"
            self.content.setdefault(block, {})[pos % bs] = tuple(tokens[: pos + 1])

    def _check_prefix(self, rid: str) -> None:
        bs, table, tokens = self.kv.block_size, self.kv.block_tables[rid], self.tokens[rid]
        for pos in range(self.computed[rid]):
            assert self.content[table[pos // bs]][pos % bs] == tuple(tokens[: pos + 1])

    @rule(target=requests, stem=st.integers(0, 2), keep=st.integers(1, 12), tail=st.lists(st.integers(0, 3), max_size=6),
          first=st.integers(1, 12))
    def new_request(self, stem: int, keep: int, tail: list[int], first: int) -> str:
        rid = f"r{self.next_id}"
        self.next_id += 1
        tokens = self.stems[stem][:keep] + tail
        cached = self.kv.cached_prefix(SequenceKey(rid, slicer(tokens)), len(tokens) - 1)
        hit = len(cached) * self.kv.block_size
        assert hit < len(tokens)
        total = min(len(tokens), hit + first)
        if not self.kv.can_allocate(rid, total, cached):
            return rid
        self.kv.allocate(rid, total, cached)
        for b in cached:
            assert self.kv.pool.ref_count(b) >= 1
        self.tokens[rid], self.computed[rid] = tokens, hit
        self._check_prefix(rid)  # the hit's blocks hold exactly this request's tokens
        self._write(rid, hit, total)
        self.computed[rid] = total
        self.kv.cache_full_blocks(SequenceKey(rid, slicer(tokens)), total)
        self.hits += hit > 0
        return rid

    @rule(rid=requests, k=st.integers(1, 6), generated=st.lists(st.integers(0, 3), max_size=3))
    def compute(self, rid: str, k: int, generated: list[int]) -> None:
        if rid not in self.tokens:
            return
        self.tokens[rid] = self.tokens[rid] + generated  # sampled tokens join the sequence
        done = self.computed[rid]
        total = min(len(self.tokens[rid]), done + k)
        if total <= done or not self.kv.can_allocate(rid, total):
            return
        self.kv.allocate(rid, total)
        for src, dst in self.kv.take_copies():
            self.content[dst] = dict(self.content.get(src, {}))
        self._write(rid, done, total)
        self.computed[rid] = total
        self.kv.cache_full_blocks(SequenceKey(rid, slicer(self.tokens[rid])), total)
        self._check_prefix(rid)

    @rule(target=requests, parent=requests)
    def fork(self, parent: str) -> str:
        rid = f"r{self.next_id}"
        self.next_id += 1
        if parent in self.tokens:
            self.kv.fork(parent, rid)
            self.tokens[rid], self.computed[rid] = list(self.tokens[parent]), self.computed[parent]
        return rid

    @rule(rid=consumes(requests))
    def end(self, rid: str) -> None:
        self.kv.free(rid)
        self.tokens.pop(rid, None)
        self.computed.pop(rid, None)

    @invariant()
    def accounting(self) -> None:
        kv, pool = self.kv, self.kv.pool
        owners: dict[int, int] = {}
        for table in kv.block_tables.values():
            for b in table:
                owners[b] = owners.get(b, 0) + 1
        plain, evictable = list(pool._free), list(pool._evictable)
        assert len(set(plain) | set(evictable)) == len(plain) + len(evictable) == pool.num_free
        assert not (set(plain) | set(evictable)) & set(owners), "a block both free and owned"
        assert len(owners) + pool.num_free == pool.num_blocks, "every block is free or owned"
        for b in range(pool.num_blocks):
            assert pool.ref_count(b) == owners.get(b, 0), f"ref count of block {b}"
        assert all(pool.key_of(b) is None for b in plain)
        assert all(pool.key_of(b) is not None for b in evictable)
        for key, b in pool._block_of.items():
            assert pool.key_of(b) == key
        assert sum(pool.key_of(b) is not None for b in range(pool.num_blocks)) == len(pool._block_of)
        # A keyed block holds the full block its key names: the recorded content hashes to it.
        for key, b in pool._block_of.items():
            prefix = self.content[b][kv.block_size - 1]
            assert list(iter_block_keys("m", list(prefix), kv.block_size))[-1] == key

    def teardown(self) -> None:
        for i in range(self.next_id):  # requests that never got a table were looked up all the same
            self.kv.free(f"r{i}")
        pool = self.kv.pool
        assert pool.num_free == pool.num_blocks and all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))
        assert self.kv._keys == {} and self.kv._num_offered == {}


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
