"""Block tables per request: which pool blocks hold a request's KV, and how many slots it uses.

Pure Python, speaks in token counts, token ids and block ids; the runner turns tables into tensors.

Prefix caching: a full block's key hashes its parent block's key and its token ids, the chain
seeded with the model's identity, so equal keys mean equal KV (same model, same tokens at the same
positions). Once computed, a request's full blocks are keyed in the pool; a later request whose
leading blocks have the same keys takes those blocks instead of computing them.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from conveyor.errors import OutOfBlocksError
from conveyor.kv.block_pool import BlockPool

# (start, end) -> the request's token ids in [start, end); Request.token_slice.
TokenSlice = Callable[[int, int], Sequence[int]]


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def root_key(model_identity: str, cache_salt: str | None = None) -> bytes:
    """The parent key of a sequence's first block: the model's identity, and the request's
    `cache_salt` if it has one (vLLM's: only requests with the same salt share cached blocks, so a
    tenant cannot learn from a hit's speed what another tenant's prompts were)."""
    key = hashlib.blake2b(model_identity.encode(), digest_size=16).digest()
    if cache_salt is not None:
        key = hashlib.blake2b(key + b"salt:" + cache_salt.encode(), digest_size=16).digest()
    return key


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    # 128 bits: a collision (two contents taken for one) is never expected in a cache's lifetime.
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def chain_keys(root: bytes, token_slice: TokenSlice, num_blocks: int, block_size: int) -> Iterator[bytes]:
    """The keys of a sequence's first num_blocks full blocks, first block first."""
    key = root
    for start in range(0, num_blocks * block_size, block_size):
        key = block_key(key, token_slice(start, start + block_size))
        yield key


def iter_block_keys(model_identity: str, token_ids: Sequence[int], block_size: int,
                    cache_salt: str | None = None) -> Iterator[bytes]:
    """The keys of the full blocks of a token sequence, first block first."""
    return chain_keys(root_key(model_identity, cache_salt), lambda start, end: token_ids[start:end],
                      len(token_ids) // block_size, block_size)


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
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, model_identity: str = ""
    ) -> None:
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
    def _key(self, request_id: str, index: int, token_slice: TokenSlice, cache_salt: str | None) -> bytes:
        keys = self._keys.setdefault(request_id, [])
        bs = self.block_size
        while len(keys) <= index:
            i = len(keys)
            parent = keys[-1] if keys else root_key(self._model_identity, cache_salt)
            keys.append(block_key(parent, token_slice(i * bs, (i + 1) * bs)))
        return keys[index]

    def _leading_hits(self, keys: Iterable[bytes]) -> list[int]:
        hits = []
        for key in keys:
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_prefix(self, request_id: str, token_slice: TokenSlice, max_tokens: int,
                      cache_salt: str | None = None) -> list[int]:
        """The blocks of the longest run of the request's leading full blocks that are cached and
        lie within its first max_tokens tokens; nothing is taken yet (pass them to allocate). Only
        for a request that holds no blocks: one with KV already resumes from it. A request's
        `cache_salt` (the same at every call for it) keeps its keys apart from other salts'."""
        if not self.enable_prefix_caching or request_id in self.block_tables:
            return []
        num_blocks = max_tokens // self.block_size
        return self._leading_hits(self._key(request_id, i, token_slice, cache_salt) for i in range(num_blocks))

    def lookup_prefix(self, token_slice: TokenSlice, max_tokens: int, cache_salt: str | None = None) -> list[int]:
        """As cached_prefix, for tokens no request of this manager holds yet (a request another
        engine computed, before it is imported): keys computed afresh, nothing remembered."""
        if not self.enable_prefix_caching:
            return []
        root = root_key(self._model_identity, cache_salt)
        return self._leading_hits(chain_keys(root, token_slice, max_tokens // self.block_size, self.block_size))

    def cache_full_blocks(self, request_id: str, num_computed_tokens: int, token_slice: TokenSlice,
                          cache_salt: str | None = None) -> None:
        """Key the request's blocks that its first num_computed_tokens tokens fill (their KV is
        written), so later requests (with the same `cache_salt`) can share them."""
        table = self.block_tables.get(request_id)
        if not self.enable_prefix_caching or not table:
            return
        offered = self._num_offered.get(request_id, 0)
        full = min(num_computed_tokens // self.block_size, len(table))
        for index in range(offered, full):
            self.pool.cache(table[index], self._key(request_id, index, token_slice, cache_salt))
        if full > offered:
            self._num_offered[request_id] = full

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
