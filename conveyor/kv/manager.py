"""Block tables per request: which pool blocks hold a request's KV, and how many slots it uses.

Pure Python, speaks in token counts, token ids and block ids; the runner turns tables into tensors.

Prefix caching: a full block's key (conveyor/kv/keys.py) says what KV it holds. Once computed, a
request's full blocks are keyed in the pool; a later request whose leading blocks have the same
keys takes those blocks instead of computing them. The cache is asked with one SequenceKey per
sequence (its request id, tokens and salt), built by conveyor/request.py's `sequence_key`.

Sliding-window layers (Gemma 3's local layers) read only a request's last `window` positions, so
the blocks holding their KV before that are given back as the request moves on. They live in a pool
of their own (SlidingWindow), with a table per request that runs beside the request's table: entry
i holds the same tokens in the window layers' cache as entry i of the main table does in the other
layers', or NULL_BLOCK once no query can see them (a block never written or read; the runner keeps
it zeroed). Prefix caching keys both tables' blocks with the same keys; a hit reaches only as far as
the window pool still holds the blocks its next query sees.

Only the scheduler changes this state (tests/test_layering.py checks): it is the one owner of a
request's blocks, handovers and imports included.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from conveyor.errors import BlockAccountingError, OutOfBlocksError
from conveyor.kv.block_pool import BlockPool
from conveyor.kv.keys import SequenceKey


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# The window pool's block 0: what a window table holds where its tokens are out of every query's sight.
NULL_BLOCK = 0


def leading_null_blocks(window_table: Sequence[int] | None) -> int:
    """How many blocks a window table has given back (they lead it: sight only moves forward)."""
    if not window_table:
        return 0
    return next((i for i, block in enumerate(window_table) if block != NULL_BLOCK), len(window_table))


@dataclass(frozen=True)
class SlidingWindow:
    """The KV of a model's sliding-window layers: `tokens` positions a query sees (itself included),
    `num_blocks` the size of their pool, NULL_BLOCK included."""

    tokens: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.num_blocks < 2:
            raise ValueError(f"a sliding window needs tokens >= 1 and num_blocks >= 2, got {self}")


def split_kv_memory(window_tokens: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                    full_block_bytes: int, window_block_bytes: int, memory: int,
                    num_blocks: int | None = None) -> tuple[int, SlidingWindow | None]:
    """(blocks of the main pool, the sliding-window layers' pool) for a model with both kinds of
    layers: `full_block_bytes` / `window_block_bytes` are a block's bytes in the layers that see the
    whole context / a window of `window_tokens`. The window pool holds what every running request
    can see at once in the worst case (a window each, with the block being written and the one
    before it; two steps' token budget of prompt chunks: an earlier step's chunk is given back at
    the request's next step; and one window more: what an import keeps before its next query's
    sight, KVCacheManager.import_window_start), and never more than the main pool; the rest of
    `memory` goes to the main pool. `num_blocks` fixes the main pool instead (its context kept).
    A main pool without a block comes back with no window: the caller refuses it."""
    window_blocks = blocks_for(window_tokens, block_size)
    in_sight = max_num_seqs * (window_blocks + 2) + 2 * blocks_for(max_num_batched_tokens, block_size) + window_blocks
    if num_blocks:
        blocks = num_blocks
    else:  # + 1: the window pool's NULL_BLOCK
        blocks = (memory - (in_sight + 1) * window_block_bytes) // full_block_bytes
        if blocks < in_sight:
            blocks = (memory - window_block_bytes) // (full_block_bytes + window_block_bytes)
    if blocks < 1:
        return blocks, None
    return blocks, SlidingWindow(window_tokens, min(in_sight, blocks) + 1)


@dataclass(frozen=True)
class KVUsage:
    used_blocks: int  # owned by some request; cached-but-evictable blocks are free
    total_blocks: int
    # Allocated slots holding no token yet: at most block_size - 1 per request by construction.
    wasted_slots: int
    num_requests: int
    evictable_blocks: int = 0  # free, but holding a cached block's KV until evicted
    # The sliding-window layers' pool (SlidingWindow), NULL_BLOCK not counted; 0 without one.
    window_used_blocks: int = 0
    window_total_blocks: int = 0

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, model_identity: str = "",
        generated_apart: bool = False, sliding_window: SlidingWindow | None = None,
    ) -> None:
        """`generated_apart`: the runner computes a prompt's tokens and generated ones differently, so
        blocks holding generated tokens are keyed apart (SequenceKey.prompt_tokens).
        `sliding_window`: the model has sliding-window layers whose KV lives in a pool of its own."""
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
        self.window = sliding_window
        self.window_pool: BlockPool | None = None
        # Per request, beside block_tables: the window layers' blocks, NULL_BLOCK where out of sight.
        self.window_tables: dict[str, list[int]] = {}
        self._num_dropped: dict[str, int] = {}  # leading entries of a window table that are NULL_BLOCK
        self.pending_window_copies: list[tuple[int, int]] = []
        if sliding_window is not None:
            self.window_pool = BlockPool(sliding_window.num_blocks)
            assert self.window_pool.allocate(1) == [NULL_BLOCK]  # held for good: never free, never cached

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
        return self._within_window_pool(hits)

    def first_visible_block(self, num_computed_tokens: int) -> int:
        """The first block the next query of a request with that many computed tokens sees in the
        window layers (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window.tokens + 1) // self.block_size

    def import_window_start(self, num_computed_tokens: int, window_held_from: int) -> int:
        """The first window entry an import keeps: what its next query sees, and up to a window's
        worth of blocks before that (a later import of a shorter prefix hits on them) where the
        exporter still held them; no more, so that an import of any length fits the pool."""
        if self.window is None:
            return 0
        sight = self.first_visible_block(num_computed_tokens)
        return max(window_held_from, sight - blocks_for(self.window.tokens, self.block_size), 0)

    def _window_hits(self, hits: Sequence[int], window_from: int = 0) -> list[int] | None:
        """The window pool's blocks for a hit on `hits` (NULL_BLOCK before the first visible one, or
        before window_from), None if it lacks one the next query sees."""
        assert self.window_pool is not None
        first = max(self.first_visible_block(len(hits) * self.block_size), min(window_from, len(hits)))
        blocks = [NULL_BLOCK] * first
        for block in hits[first:]:
            key = self.pool.key_of(block)
            window_block = self.window_pool.lookup(key) if key is not None else None
            if window_block is None:
                return None
            blocks.append(window_block)
        return blocks

    def _within_window_pool(self, hits: list[int]) -> list[int]:
        """The longest head of `hits` whose window blocks the window pool holds too: one pass over
        which of their window blocks it holds, then the longest head whose visible run is held."""
        window_pool = self.window_pool
        if window_pool is None:
            return hits
        held_run = 0  # how many blocks up to this one the window pool holds in a row
        runs = []
        for block in hits:
            key = self.pool.key_of(block)
            held_run = held_run + 1 if key is not None and window_pool.lookup(key) is not None else 0
            runs.append(held_run)
        for length in range(len(hits), 0, -1):
            if runs[length - 1] >= length - self.first_visible_block(length * self.block_size):
                return hits[:length]
        return []

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
        window_table = self.window_tables.get(key.request_id)
        for index in range(offered, full):
            block_key = self._key(key, index)
            self.pool.cache(table[index], block_key)
            if window_table is not None and window_table[index] != NULL_BLOCK:
                assert self.window_pool is not None
                self.window_pool.cache(window_table[index], block_key)
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

    def window_blocks_to_start(self, num_total_tokens: int, cached: Sequence[int] = (), window_from: int = 0) -> int:
        """blocks_to_start for the window pool: the blocks past `cached` (from entry window_from on),
        and each of the window blocks a hit on `cached` takes that is evictable (0 without a window)."""
        if self.window_pool is None:
            return 0
        new = max(0, blocks_for(num_total_tokens, self.block_size) - max(len(cached), window_from))
        hits = self._window_hits(cached, window_from) if cached else []
        if hits is None:  # no longer held: allocate refuses the hit
            return new + len(cached)
        return new + sum(1 for b in hits if b != NULL_BLOCK and self.window_pool.ref_count(b) == 0)

    def _window_needs(self, request_id: str, num_total_tokens: int, cached: Sequence[int] = (),
                      window_from: int = 0) -> int:
        """Free window blocks the request takes to have window slots for num_total_tokens, net of the
        blocks it gives back first (those out of its next query's sight), copy-on-write included."""
        pool = self.window_pool
        assert pool is not None
        table = self.window_tables.get(request_id)
        if not table:
            return self.window_blocks_to_start(num_total_tokens, cached, window_from)
        bs = self.block_size
        written = self.num_slotted_tokens.get(request_id, 0)
        new = max(0, blocks_for(num_total_tokens, bs) - len(table))
        cow = num_total_tokens > written and written % bs != 0 and pool.ref_count(table[written // bs]) > 1
        dropped, first = self._num_dropped.get(request_id, 0), self.first_visible_block(written)
        given_back = sum(1 for b in table[dropped:first] if pool.ref_count(b) == 1)
        return new + cow - given_back

    def can_allocate(self, request_id: str, num_total_tokens: int, cached: Sequence[int] = (),
                     window_from: int = 0) -> bool:
        new, copy_on_write = self._needs(request_id, num_total_tokens, cached)
        if new + copy_on_write > self.pool.num_free:
            return False
        return (self.window_pool is None
                or self._window_needs(request_id, num_total_tokens, cached, window_from) <= self.window_pool.num_free)

    def allocate(self, request_id: str, num_total_tokens: int, cached: Sequence[int] = (),
                 window_from: int = 0) -> list[int]:
        """Grow the request's table so that it has slots for num_total_tokens; append-only
        except that a shared block about to be written is swapped for a private copy. `cached`
        (from cached_prefix, for a request holding no blocks) become the head of its table and
        their tokens count as slotted. `window_from`, for a table that starts here: its window
        table holds nothing before that entry (an import: import_window_start). Returns the newly
        allocated blocks."""
        starts = request_id not in self.block_tables
        if cached and not starts:
            raise ValueError(f"{request_id!r} holds blocks already; a prefix hit starts a table")
        # The main pool refuses in pool.allocate, before its table changes; a hit and the window pool,
        # whose tables change first, are checked here (the window's part alone, not can_allocate
        # again: allocate runs for every scheduled request at every step).
        if (cached and not self.can_allocate(request_id, num_total_tokens, cached, window_from)) or (
                self.window_pool is not None and self._window_needs(request_id, num_total_tokens, cached, window_from)
                > self.window_pool.num_free):
            raise OutOfBlocksError(f"{request_id!r} needs more blocks than are free")
        if cached:
            window_hits = self._window_hits(cached, window_from) if self.window_pool is not None else None
            if self.window_pool is not None and window_hits is None:
                raise BlockAccountingError(f"the window pool no longer holds the blocks of {request_id!r}'s hit")
            for block in cached:
                self.pool.take_cached(block)
            self.block_tables[request_id] = list(cached)
            self.num_slotted_tokens[request_id] = len(cached) * self.block_size
            self._num_offered[request_id] = len(cached)
            if window_hits is not None:
                assert self.window_pool is not None
                for block in window_hits:
                    if block != NULL_BLOCK:
                        self.window_pool.take_cached(block)
                self.window_tables[request_id] = window_hits
                self._num_dropped[request_id] = window_hits.count(NULL_BLOCK)
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
        if self.window_pool is not None:
            self._grow_window_table(request_id, num_total_tokens, window_from if starts else 0)
        self.num_slotted_tokens[request_id] = max(
            num_total_tokens, self.num_slotted_tokens.get(request_id, 0)
        )
        return new_blocks

    def _grow_window_table(self, request_id: str, num_total_tokens: int, window_from: int = 0) -> None:
        """The window table's part of allocate (can_allocate has checked the pool): give back the
        blocks out of sight, copy a shared tail about to be written, append new blocks (NULL_BLOCK
        before window_from, for a table that starts here)."""
        pool = self.window_pool
        assert pool is not None
        table = self.window_tables.setdefault(request_id, [])
        # A start's entries before window_from: a hit's are NULL_BLOCK already (_window_hits), so
        # these extend a run of them from the table's head.
        nulls = min(window_from, blocks_for(num_total_tokens, self.block_size)) - len(table)
        if nulls > 0:
            table.extend([NULL_BLOCK] * nulls)
            self._num_dropped[request_id] = len(table)
        self.drop_out_of_sight(request_id)
        bs = self.block_size
        written = self.num_slotted_tokens.get(request_id, 0)
        cow = num_total_tokens > written and written % bs != 0 and pool.ref_count(table[written // bs]) > 1
        new = max(0, blocks_for(num_total_tokens, bs) - len(table))
        blocks = pool.allocate(new + cow) if new or cow else []
        if cow:
            index = written // bs
            private = blocks.pop()
            self.pending_window_copies.append((table[index], private))
            pool.free([table[index]])
            table[index] = private
        table.extend(blocks)

    def drop_out_of_sight(self, request_id: str) -> None:
        """Give back the request's window blocks that its next query cannot see (those before
        first_visible_block of its slotted tokens); keyed ones stay cached until evicted."""
        table = self.window_tables.get(request_id)
        if table is None:
            return
        assert self.window_pool is not None
        dropped = self._num_dropped.get(request_id, 0)
        first = min(self.first_visible_block(self.num_slotted_tokens.get(request_id, 0)), len(table))
        if first > dropped:
            self.window_pool.free(table[dropped:first])
            table[dropped:first] = [NULL_BLOCK] * (first - dropped)
            self._num_dropped[request_id] = first

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
        window = self.window_tables.get(parent_id)
        if window is not None:
            assert self.window_pool is not None
            for block in window:
                if block != NULL_BLOCK:
                    self.window_pool.share(block)
            self.window_tables[child_id] = list(window)
            self._num_dropped[child_id] = self._num_dropped.get(parent_id, 0)

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
        window = self.window_tables.get(request_id)
        if window is not None and len(window) > keep:
            assert self.window_pool is not None
            self.window_pool.free([b for b in window[keep:] if b != NULL_BLOCK])
            del window[keep:]

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_window_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_window_copies = self.pending_window_copies, []
        return copies

    def free(self, request_id: str) -> None:
        """Give back the request's blocks (its keyed ones stay cached until evicted) and forget it."""
        table = self.block_tables.pop(request_id, None)
        self.num_slotted_tokens.pop(request_id, None)
        self._keys.pop(request_id, None)
        self._num_offered.pop(request_id, None)
        if table:
            self.pool.free(table)
        window = self.window_tables.pop(request_id, None)
        self._num_dropped.pop(request_id, None)
        if window:
            assert self.window_pool is not None
            self.window_pool.free([b for b in window if b != NULL_BLOCK])

    def usage(self) -> KVUsage:
        slots = sum(len(t) for t in self.block_tables.values()) * self.block_size
        return KVUsage(
            used_blocks=self.pool.num_used,
            total_blocks=self.pool.num_blocks,
            wasted_slots=slots - sum(self.num_slotted_tokens.values()),
            num_requests=len(self.block_tables),
            evictable_blocks=self.pool.num_evictable,
            window_used_blocks=self.window_pool.num_used - 1 if self.window_pool is not None else 0,
            window_total_blocks=self.window_pool.num_blocks - 1 if self.window_pool is not None else 0,
        )
