"""A fixed pool of KV blocks: a free list and a ref count per block; O(1) allocate and free."""
from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """Asked for more blocks than are free; callers check `num_free` first, so this is a bug."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def share(self, block_id: int) -> None:
        """Another owner takes a reference (e.g. a parallel sample reusing a prompt block)."""
        if self._ref_counts[block_id] < 1:
            raise ValueError(f"block {block_id} is free and cannot be shared")
        self._ref_counts[block_id] += 1

    def free(self, blocks: list[int]) -> None:
        # Reverse order: the tail of a sequence goes back first, so the head blocks, which a
        # future prefix cache would most likely reuse, stay out of the free list longest.
        for b in reversed(blocks):
            count = self._ref_counts[b]
            if count < 1:
                raise ValueError(f"block {b} freed twice")
            self._ref_counts[b] = count - 1
            if count == 1:
                self._free.append(b)
