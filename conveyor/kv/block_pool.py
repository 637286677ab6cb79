"""A fixed pool of KV blocks: ref counts, a free list, and content keys for prefix caching.

A block with ref count 0 is free. A free block with no key is plain; a free block that still holds
the KV of a full, keyed block (prefix caching) is evictable: it waits, least recently freed first,
in case a later request with the same prefix takes it back. Allocation takes plain blocks first and
evicts (drops the key of) the least recently freed evictable block only when no plain one is left.
Plain blocks go out most recently freed first, never-used ones (in id order) after them: the runner
maps a block's memory when it is first written, so plain reuse stays within the blocks already
written, and a server without prefix caching holds the KV its busiest moment used, not the pool.
Every operation is O(1) per block: the plain list is a deque (only its ends are touched) and the
evictable list an OrderedDict, so a hit removes a block from the middle in O(1).
"""
from __future__ import annotations

from collections import OrderedDict, deque

from conveyor.errors import BlockAccountingError, OutOfBlocksError


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(reversed(range(num_blocks)))  # plain free blocks, taken from the right
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free keyed blocks, LRU first
        self._ref_counts = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: plain free ones and cached-but-evictable ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a key, owned or evictable."""
        return len(self._block_of)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def key_of(self, block_id: int) -> bytes | None:
        return self._key_of[block_id]

    def lookup(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocksError(f"asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                key = self._key_of[block]
                assert key is not None  # an evictable block is a cached one
                del self._block_of[key]
                self._key_of[block] = None
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, block_id: int) -> None:
        """Another owner takes a reference (e.g. a parallel sample reusing a prompt block)."""
        if self._ref_counts[block_id] < 1:
            raise BlockAccountingError(f"block {block_id} is free and cannot be shared")
        self._ref_counts[block_id] += 1

    def take_cached(self, block_id: int) -> None:
        """A prefix-cache hit: take a reference to a keyed block, owned or evictable."""
        if self._key_of[block_id] is None:
            raise BlockAccountingError(f"block {block_id} holds no cached content")
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def cache(self, block_id: int, key: bytes) -> bool:
        """Give an owned, full block its content key; False (and nothing changes) if the block has a
        key already or another block holds the same content (the first one stays the cached copy)."""
        if self._ref_counts[block_id] < 1:
            raise BlockAccountingError(f"block {block_id} is free and cannot be cached")
        if self._key_of[block_id] is not None or key in self._block_of:
            return False
        self._key_of[block_id] = key
        self._block_of[key] = block_id
        return True

    def free(self, blocks: list[int]) -> None:
        # Reverse order: the tail of a sequence goes back first, so its head, which later requests
        # are likeliest to share, is evicted last.
        for b in reversed(blocks):
            count = self._ref_counts[b]
            if count < 1:
                raise BlockAccountingError(f"block {b} freed twice")
            self._ref_counts[b] = count - 1
            if count == 1:
                if self._key_of[b] is None:
                    self._free.append(b)
                else:
                    self._evictable[b] = None
