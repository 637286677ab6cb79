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
    # How many of its tokens are the prompt (None: all of those asked about). Where the engine
    # computes a prompt's tokens and generated ones with different kernels (bf16 tiles against int8),
    # a block holding tokens past the prompt is keyed apart from the same tokens met as a prompt
    # (`generated_apart`), so a hit hands a request only KV computed as it would compute it.
    prompt_tokens: int | None = None

    def root(self, model_identity: str) -> bytes:
        """The parent key of the sequence's first block."""
        key = hashlib.blake2b(model_identity.encode(), digest_size=16).digest()
        if self.salt is not None:
            key = hashlib.blake2b(key + b"salt:" + self.salt.encode(), digest_size=16).digest()
        return key

    def block_keys(self, model_identity: str, num_blocks: int, block_size: int,
                   generated_apart: bool = False) -> Iterator[bytes]:
        """The keys of the sequence's first num_blocks full blocks, first block first."""
        key = self.root(model_identity)
        for index in range(num_blocks):
            key = self.next_key(key, index, block_size, generated_apart)
            yield key

    def next_key(self, parent: bytes, index: int, block_size: int, generated_apart: bool) -> bytes:
        """Block `index`'s key, given its parent's."""
        start = index * block_size
        tokens = self.token_slice(start, start + block_size)
        if generated_apart and self.prompt_tokens is not None and start + block_size > self.prompt_tokens:
            return block_key(parent, tokens, generated_from=max(0, self.prompt_tokens - start))
        return block_key(parent, tokens)


def block_key(parent: bytes, token_ids: Sequence[int], generated_from: int | None = None) -> bytes:
    """`generated_from`: the block's first token that is not the prompt's (None: it is all prompt)."""
    # 128 bits: a collision (two contents taken for one) is never expected in a cache's lifetime.
    content = parent + array("q", token_ids).tobytes()
    if generated_from is not None:
        content += b"generated-from:" + str(generated_from).encode()
    return hashlib.blake2b(content, digest_size=16).digest()


def iter_block_keys(model_identity: str, token_ids: Sequence[int], block_size: int,
                    salt: str | None = None) -> Iterator[bytes]:
    """The keys of the full blocks of a token sequence, first block first."""
    key = SequenceKey("", lambda start, end: token_ids[start:end], salt)
    return key.block_keys(model_identity, len(token_ids) // block_size, block_size)
