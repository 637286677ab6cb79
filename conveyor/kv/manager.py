"""Block tables per request: which pool blocks hold a request's KV, and how many slots it uses.

Pure Python, speaks in token counts and block ids; the runner turns tables into tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

from conveyor.kv.block_pool import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class KVUsage:
    used_blocks: int
    total_blocks: int
    # Allocated slots holding no token yet: at most block_size - 1 per request by construction.
    wasted_slots: int
    num_requests: int

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        # Tokens that have a slot (computed, or being computed this step).
        self.num_slotted_tokens: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def num_new_blocks(self, request_id: str, num_total_tokens: int) -> int:
        have = len(self.block_tables.get(request_id, ()))
        return max(0, blocks_for(num_total_tokens, self.block_size) - have)

    def can_allocate(self, request_id: str, num_total_tokens: int) -> bool:
        return self.num_new_blocks(request_id, num_total_tokens) <= self.pool.num_free

    def allocate(self, request_id: str, num_total_tokens: int) -> list[int]:
        """Grow the request's table so that it has slots for num_total_tokens; append-only."""
        # Take the blocks before touching the table: OutOfBlocksError must leave no empty entry.
        new_blocks = self.pool.allocate(self.num_new_blocks(request_id, num_total_tokens))
        self.block_tables.setdefault(request_id, []).extend(new_blocks)
        self.num_slotted_tokens[request_id] = max(
            num_total_tokens, self.num_slotted_tokens.get(request_id, 0)
        )
        return new_blocks

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        self.num_slotted_tokens.pop(request_id, None)
        if table:
            self.pool.free(table)

    def usage(self) -> KVUsage:
        slots = sum(len(t) for t in self.block_tables.values()) * self.block_size
        return KVUsage(
            used_blocks=self.pool.num_used,
            total_blocks=self.pool.num_blocks,
            wasted_slots=slots - sum(self.num_slotted_tokens.values()),
            num_requests=len(self.block_tables),
        )
