"""Block tables per request: which pool blocks hold a request's KV, and how many slots it uses.

Pure Python, speaks in token counts, token ids and block ids; the runner turns tables into tensors.

Prefix caching: a full block's key (conveyor/kv/keys.py) says what KV it holds. Once computed, a
request's full blocks are keyed in the pool; a later request whose leading blocks have the same
keys takes those blocks instead of computing them. The cache is asked with one SequenceKey per
sequence (its request id, tokens and salt), built by conveyor/request.py's `sequence_key`.

Only the scheduler changes this state (tests/test_layering.py checks): it is the one owner of a
request's blocks, handovers and imports included.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from conveyor.errors import OutOfBlocksError
from conveyor.kv.block_pool import BlockPool
from conveyor.kv.keys import SequenceKey


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class KVUsage:
    used_blocks: int  # owned by some request; cached-but-evictable blocks are free
    total_blocks: int
    # Allocated slots holding no token yet: at most block_size - 1 per request by construction.
    wasted_slots: int
    num_requests: int
    evictable_blocks: int = 0  # free, but holding a cached block's KV until evicted

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, model_identity: str = "",
        generated_apart: bool = False,
    ) -> None:
        """`generated_apart`: the runner computes a prompt's tokens and generated ones differently, so
        blocks holding generated tokens are keyed apart (SequenceKey.prompt_tokens)."""
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        # Tokens that have a slot (computed, or being computed this step).
        self.num_slotted_tokens: dict[str, int] = {}
        # (source, destination) block copies the runner must make before the next forward:
        # copy-on-write of a shared, partly filled block that one of its owners writes into.
        self.pending_copies: list[tuple[int, int]] = []
        self._model_identity = model_identity
        self._generated_apart = generated_apart
        # Per request: keys of its leading full blocks computed so far (a memo: tokens only append),
        # and how many leading blocks of its table have been offered to the cache.
        self._keys: dict[str, list[bytes]] = {}
        self._num_offered: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take, evictable cached ones included."""
        return self.pool.num_free

    # --- prefix cache ---------------------------------------------------------------------------
    def _key(self, key: SequenceKey, index: int) -> bytes:
        keys = self._keys.setdefault(key.request_id, [])
        bs = self.block_size
        while len(keys) <= index:
            i = len(keys)
            parent = keys[-1] if keys else key.root(self._model_identity)
            keys.append(key.next_key(parent, i, bs, self._generated_apart))
        return keys[index]

    def _leading_hits(self, keys: Iterable[bytes]) -> list[int]:
        hits = []
        for key in keys:
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_prefix(self, key: SequenceKey, max_tokens: int) -> list[int]:
        """The blocks of the longest run of the request's leading full blocks that are cached and
        lie within its first max_tokens tokens; nothing is taken yet (pass them to allocate). Only
        for a request that holds no blocks: one with KV already resumes from it. The key's
        ingredients (its salt) are the same at every call for a request."""
        if not self.enable_prefix_caching or key.request_id in self.block_tables:
            return []
        num_blocks = max_tokens // self.block_size
        return self._leading_hits(self._key(key, i) for i in range(num_blocks))

    def lookup_prefix(self, key: SequenceKey, max_tokens: int) -> list[int]:
        """As cached_prefix, for tokens no request of this manager holds yet (a request another
        engine computed, before it is imported): keys computed afresh, nothing remembered."""
        if not self.enable_prefix_caching:
            return []
        return self._leading_hits(key.block_keys(self._model_identity, max_tokens // self.block_size,
                                                 self.block_size, self._generated_apart))

    def cache_full_blocks(self, key: SequenceKey, num_computed_tokens: int) -> None:
        """Key the request's blocks that its first num_computed_tokens tokens fill (their KV is
        written), so later requests (with the same key ingredients) can share them."""
        table = self.block_tables.get(key.request_id)
        if not self.enable_prefix_caching or not table:
            return
        offered = self._num_offered.get(key.request_id, 0)
        full = min(num_computed_tokens // self.block_size, len(table))
        for index in range(offered, full):
            self.pool.cache(table[index], self._key(key, index))
        if full > offered:
            self._num_offered[key.request_id] = full

    # --- allocation -----------------------------------------------------------------------------
    def _needs(self, request_id: str, num_total_tokens: int, cached: Sequence[int] = ()) -> tuple[int, bool]:
        """(blocks to take from the free list, copy-on-write of the tail), in one lookup: the
        scheduler asks this for every running request at every step. `cached` blocks (a prefix hit
        for a request holding none) cost a free block each only while they are evictable."""
        table = self.block_tables.get(request_id)
        bs = self.block_size
        if not table:
            return self.blocks_to_start(num_total_tokens, cached), False
        new = -(-num_total_tokens // bs) - len(table)
        written = self.num_slotted_tokens.get(request_id, 0)
        cow = num_total_tokens > written and written % bs != 0 and self.pool.ref_count(table[written // bs]) > 1
        return (new if new > 0 else 0), cow

    def blocks_to_start(self, num_total_tokens: int, cached: Sequence[int] = ()) -> int:
        """Free blocks a new table takes for num_total_tokens slots when it starts with `cached`:
        the blocks past them, and each cached one that is evictable (free) rather than owned."""
        new = max(blocks_for(num_total_tokens, self.block_size), len(cached)) - len(cached)
        return new + sum(1 for b in cached if self.pool.ref_count(b) == 0)

    def can_allocate(self, request_id: str, num_total_tokens: int, cached: Sequence[int] = ()) -> bool:
        new, copy_on_write = self._needs(request_id, num_total_tokens, cached)
        return new + copy_on_write <= self.pool.num_free

    def allocate(self, request_id: str, num_total_tokens: int, cached: Sequence[int] = ()) -> list[int]:
        """Grow the request's table so that it has slots for num_total_tokens; append-only
        except that a shared block about to be written is swapped for a private copy. `cached`
        (from cached_prefix, for a request holding no blocks) become the head of its table and
        their tokens count as slotted. Returns the newly allocated blocks."""
        if cached:
            if request_id in self.block_tables:
                raise ValueError(f"{request_id!r} holds blocks already; a prefix hit starts a table")
            if not self.can_allocate(request_id, num_total_tokens, cached):
                raise OutOfBlocksError(f"{request_id!r} needs more blocks than are free")
            for block in cached:
                self.pool.take_cached(block)
            self.block_tables[request_id] = list(cached)
            self.num_slotted_tokens[request_id] = len(cached) * self.block_size
            self._num_offered[request_id] = len(cached)
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
        if parent_id in self._keys:
            self._keys[child_id] = list(self._keys[parent_id])
        if parent_id in self._num_offered:
            self._num_offered[child_id] = self._num_offered[parent_id]

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep slots for the request's first num_tokens tokens only: speculative tokens the model
        rejected give their slots back, and the blocks past the kept ones return to the pool. Those
        blocks were never keyed (only computed, verified tokens are offered to the cache), and hold
        only this request's rejected tokens; their slots are written again when the request gets
        that far."""
        table = self.block_tables.get(request_id)
        if table is None or self.num_slotted_tokens.get(request_id, 0) <= num_tokens:
            return
        self.num_slotted_tokens[request_id] = num_tokens
        keep = max(blocks_for(num_tokens, self.block_size), self._num_offered.get(request_id, 0))
        if len(table) > keep:
            self.pool.free(table[keep:])
            del table[keep:]

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, request_id: str) -> None:
        """Give back the request's blocks (its keyed ones stay cached until evicted) and forget it."""
        table = self.block_tables.pop(request_id, None)
        self.num_slotted_tokens.pop(request_id, None)
        self._keys.pop(request_id, None)
        self._num_offered.pop(request_id, None)
        if table:
            self.pool.free(table)

    def usage(self) -> KVUsage:
        slots = sum(len(t) for t in self.block_tables.values()) * self.block_size
        return KVUsage(
            used_blocks=self.pool.num_used,
            total_blocks=self.pool.num_blocks,
            wasted_slots=slots - sum(self.num_slotted_tokens.values()),
            num_requests=len(self.block_tables),
            evictable_blocks=self.pool.num_evictable,
        )
