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
        # (source, destination) block copies the runner must make before the next forward:
        # copy-on-write of a shared, partly filled block that one of its owners writes into.
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def num_new_blocks(self, request_id: str, num_total_tokens: int) -> int:
        have = len(self.block_tables.get(request_id, ()))
        return max(0, blocks_for(num_total_tokens, self.block_size) - have)

    def _shared_tail(self, request_id: str, num_total_tokens: int) -> bool:
        """Will the request write into a block it shares with another owner?"""
        table = self.block_tables.get(request_id)
        written = self.num_slotted_tokens.get(request_id, 0)
        if not table or num_total_tokens <= written or written % self.block_size == 0:
            return False  # nothing to write, or the next token opens a fresh block
        return self.pool.ref_count(table[written // self.block_size]) > 1

    def _needs(self, request_id: str, num_total_tokens: int) -> tuple[int, bool]:
        """(new blocks, copy-on-write of the tail) in one lookup: num_new_blocks and _shared_tail
        fused, since the scheduler asks this for every running request at every step."""
        table = self.block_tables.get(request_id)
        bs = self.block_size
        if not table:
            return -(-num_total_tokens // bs), False
        new = -(-num_total_tokens // bs) - len(table)
        written = self.num_slotted_tokens.get(request_id, 0)
        cow = num_total_tokens > written and written % bs != 0 and self.pool.ref_count(table[written // bs]) > 1
        return (new if new > 0 else 0), cow

    def can_allocate(self, request_id: str, num_total_tokens: int) -> bool:
        new, copy_on_write = self._needs(request_id, num_total_tokens)
        return new + copy_on_write <= self.pool.num_free

    def allocate(self, request_id: str, num_total_tokens: int) -> list[int]:
        """Grow the request's table so that it has slots for num_total_tokens; append-only
        except that a shared block about to be written is swapped for a private copy."""
        # Take the blocks before touching the table: OutOfBlocksError must leave no empty entry.
        new, copy_on_write = self._needs(request_id, num_total_tokens)
        new_blocks = self.pool.allocate(new + copy_on_write) if new or copy_on_write else []
        table = self.block_tables.setdefault(request_id, [])
        if copy_on_write:
            index = self.num_slotted_tokens[request_id] // self.block_size
            private = new_blocks.pop()
            self.pending_copies.append((table[index], private))
            self.pool.free([table[index]])
            table[index] = private
        table.extend(new_blocks)
        self.num_slotted_tokens[request_id] = max(
            num_total_tokens, self.num_slotted_tokens.get(request_id, 0)
        )
        return new_blocks

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (ref counts), e.g. a prompt's KV for n > 1."""
        table = self.block_tables[parent_id]
        for block in table:
            self.pool.share(block)
        self.block_tables[child_id] = list(table)
        self.num_slotted_tokens[child_id] = self.num_slotted_tokens[parent_id]

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

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
