"""Prefix-cache keys: what a sequence's full blocks are known by.

A full block's key hashes its parent block's key and its token ids, the chain seeded with the
model's identity and whatever else keeps sequences apart (a request's salt), so equal keys mean
equal KV (same model, same tokens at the same positions, same isolation). Pure Python.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

# (start, end) -> the sequence's token ids in [start, end); Request.token_slice.
TokenSlice = Callable[[int, int], Sequence[int]]


@dataclass(frozen=True)
class SequenceKey:
    """What the prefix cache is asked with about one sequence: whose it is (the KV manager
    remembers a request's block keys by its id), its tokens, and what else keys its blocks apart.
    Built from a request by conveyor/request.py's `sequence_key`: a new ingredient of the key joins
    there and in `root` below, nowhere else."""

    request_id: str
    token_slice: TokenSlice
    # vLLM's `cache_salt`: only sequences with the same salt share cached blocks, so a tenant cannot
    # learn from a hit's speed what another tenant's prompts were. None is a salt of its own.
    salt: str | None = None

    def root(self, model_identity: str) -> bytes:
        """The parent key of the sequence's first block."""
        key = hashlib.blake2b(model_identity.encode(), digest_size=16).digest()
        if self.salt is not None:
            key = hashlib.blake2b(key + b"salt:" + self.salt.encode(), digest_size=16).digest()
        return key

    def block_keys(self, model_identity: str, num_blocks: int, block_size: int) -> Iterator[bytes]:
        """The keys of the sequence's first num_blocks full blocks, first block first."""
        key = self.root(model_identity)
        for start in range(0, num_blocks * block_size, block_size):
            key = block_key(key, self.token_slice(start, start + block_size))
            yield key


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    # 128 bits: a collision (two contents taken for one) is never expected in a cache's lifetime.
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def iter_block_keys(model_identity: str, token_ids: Sequence[int], block_size: int,
                    salt: str | None = None) -> Iterator[bytes]:
    """The keys of the full blocks of a token sequence, first block first."""
    key = SequenceKey("", lambda start, end: token_ids[start:end], salt)
    return key.block_keys(model_identity, len(token_ids) // block_size, block_size)
