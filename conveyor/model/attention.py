"""Attention over a paged KV cache.

The cache of one layer is a pair of arrays [num_blocks, block_size, kv_heads, head_dim] (float16 or
float32). New keys and values are scattered into it through a flat slot mapping; queries read their
context back through block tables. Single-query rows (decodes) are attended in one batched call (a
C++ kernel that reads the blocks in place, or gather + a masked softmax in numpy as the fallback);
multi-token prefill chunks, which are few and large, one call each (a C++ kernel that reads the
blocks in place, or the numpy reference). Queries and arithmetic are fp32.

A sliding-window layer (Gemma's local layers) passes `window`: a query at position p then sees
positions p - window + 1 .. p only (as HF's sliding mask: key > query - window), and only the
blocks holding those positions are read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from conveyor.model.kernels import PagedDecodeKernel, PagedPrefillKernel, paged_decode_kernel, paged_prefill_kernel


@dataclass
class PrefillChunk:
    token_start: int  # first row of this chunk in the flat batch
    num_tokens: int
    num_cached: int  # tokens of this request already in the cache before the chunk
    block_table: np.ndarray  # int64 [blocks covering num_cached + num_tokens]


@dataclass
class AttentionMetadata:
    """Built once per step by the runner and shared by every layer."""

    slot_mapping: np.ndarray  # int64 [T] flat slot (block * block_size + offset) of each new token
    num_decode_tokens: int  # the first rows of the batch are single-query requests
    decode_block_tables: np.ndarray | None  # [D, max_blocks], int64, padded with block 0
    decode_context_lens: np.ndarray | None  # [D], int64: tokens each decode row attends to
    prefills: list[PrefillChunk]
    # Rows [start, end) that compute prompt tokens (the rest compute generated ones): where the
    # products take prompt tokens on their own kernel (linear.PromptRows), these are they.
    prompt_rows: tuple[tuple[int, int], ...] = ()
    # The same step in the sliding-window layers' own KV pool (slots and tables; the runner's
    # kv_window), None where those layers share the others' pool.
    window_group: AttentionMetadata | None = None
    _decode_masks: dict[int | None, np.ndarray] = field(default_factory=dict, repr=False)

    def decode_mask(self, block_size: int, window: int | None = None) -> np.ndarray:
        """[D, max_blocks * block_size], True where a key is visible (the numpy fallback's padding
        and, with `window`, the positions before each row's window). One per window size."""
        if window not in self._decode_masks:
            assert self.decode_block_tables is not None and self.decode_context_lens is not None
            width = self.decode_block_tables.shape[1] * block_size
            keys, lens = np.arange(width)[None, :], self.decode_context_lens[:, None]
            visible = keys < lens
            if window is not None:
                visible &= keys >= lens - window
            self._decode_masks[window] = visible
        return self._decode_masks[window]

    def rows(self, start: int, end: int) -> AttentionMetadata:
        """This step restricted to its rows [start, end), numbered from `start`: what a layer needs to
        compute those rows alone, before the rows after them (LlamaModel's runs of rows). A prefill
        chunk cut at `start` goes on from the keys its earlier rows wrote, as a chunked prefill's next
        chunk does."""
        if start == 0 and end == len(self.slot_mapping):
            return self
        decode_end = min(end, self.num_decode_tokens)
        tables = lens = None
        if decode_end > start:
            assert self.decode_block_tables is not None and self.decode_context_lens is not None
            tables, lens = self.decode_block_tables[start:decode_end], self.decode_context_lens[start:decode_end]
        prefills = []
        for chunk in self.prefills:
            first, last = max(chunk.token_start, start), min(chunk.token_start + chunk.num_tokens, end)
            if first < last:
                prefills.append(PrefillChunk(first - start, last - first, chunk.num_cached + first - chunk.token_start,
                                             chunk.block_table))
        prompt_rows = tuple((max(s, start) - start, min(e, end) - start) for s, e in self.prompt_rows
                            if s < end and e > start)
        window_group = None if self.window_group is None else self.window_group.rows(start, end)
        return AttentionMetadata(self.slot_mapping[start:end], max(0, decode_end - start), tables, lens, prefills,
                                 prompt_rows, window_group)


# The prefill kernel's compiled-in head sizes (others take the numpy reference).
PREFILL_KERNEL_HEAD_DIMS = (64, 128, 256)


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> None:
    """k, v [T, kv_heads, d] into the cache slots, in the cache's dtype (rounded to nearest even)."""
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        # reshape would then copy, and the writes would land in the copy
        raise ValueError("write_kv: the KV caches must be contiguous")
    k_cache.reshape(-1, *k.shape[1:])[slots] = k.astype(k_cache.dtype, copy=False)
    v_cache.reshape(-1, *v.shape[1:])[slots] = v.astype(v_cache.dtype, copy=False)


def _gather(cache: np.ndarray, block_tables: np.ndarray) -> np.ndarray:
    """[..., blocks] block ids -> fp32 [..., kv_heads, blocks * block_size, head_dim]."""
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    # whole blocks as rows
    rows = cache.reshape(num_blocks, -1)[block_tables.reshape(-1)].astype(np.float32, copy=False)
    flat = rows.reshape(*block_tables.shape[:-1], block_tables.shape[-1] * block_size, kv_heads, head_dim)
    return np.swapaxes(flat, -3, -2)


# The reference attention takes a prefill chunk's queries this many at a time: its scores are
# [heads, queries, keys] fp32, which for a whole 2,048-token chunk of a 32-head model is 512 MiB.
QUERY_BLOCK = 256


def masked_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray, scale: float) -> np.ndarray:
    """The reference attention: q [..., heads, n, d], k and v [..., kv_heads, L, d] (a query head h
    reads KV head h // (heads / kv_heads), as HF's repeat_kv), visible [..., n, L] bool. softmax(q k^T
    scale, masked) v in fp32, the maximum subtracted first, QUERY_BLOCK queries at a time (each row's
    arithmetic is its own). Returns [..., heads, n, d]."""
    n = q.shape[-2]
    if n > QUERY_BLOCK:
        return np.concatenate([masked_attention(q[..., start:start + QUERY_BLOCK, :], k, v,
                                                visible[..., start:start + QUERY_BLOCK, :], scale)
                               for start in range(0, n, QUERY_BLOCK)], axis=-2)
    heads, kv_heads = q.shape[-3], k.shape[-3]
    group = heads // kv_heads
    qg = q.reshape(*q.shape[:-3], kv_heads, group, *q.shape[-2:])  # [..., kv_heads, group, n, d]
    scores = np.matmul(qg, np.swapaxes(k, -1, -2)[..., :, None, :, :]) * np.float32(scale)
    scores = np.where(visible[..., None, None, :, :], scores, np.float32(-np.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, v[..., :, None, :, :])  # [..., kv_heads, group, n, d]
    return out.reshape(*q.shape).astype(np.float32, copy=False)


def attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    meta: AttentionMetadata,
    scale: float,
    decode_kernel: PagedDecodeKernel | None | Literal["resolve"] = "resolve",
    window: int | None = None,
    prefill_kernel: PagedPrefillKernel | None | Literal["resolve"] = "resolve",
) -> np.ndarray:
    """q: [T, heads, d] fp32; k, v: [T, kv_heads, d] for the new tokens, already written into the
    cache at meta.slot_mapping (write_kv, or the fused rope_and_cache). Returns [T, heads, d].
    `decode_kernel`: paged_decode_kernel() as the caller resolved it once per forward pass (None:
    the numpy fallback), or "resolve" to look it up here; `prefill_kernel` likewise, from
    paged_prefill_kernel(), for the prefill chunks. `window`: a sliding window's size (None: all)."""
    num_decode = meta.num_decode_tokens
    if isinstance(decode_kernel, str):
        decode_kernel = paged_decode_kernel()
    kernel = decode_kernel if num_decode and q.dtype == np.float32 else None
    tables, context_lens = meta.decode_block_tables, meta.decode_context_lens
    if kernel is not None and num_decode == q.shape[0]:  # a pure decode step: the kernel's output is all of it
        assert tables is not None and context_lens is not None  # build_inputs sets both for decode rows
        return kernel(np.ascontiguousarray(q), k_cache, v_cache, tables, context_lens, scale, window or 0)
    out = np.empty(q.shape, dtype=np.float32)
    if num_decode:
        assert tables is not None and context_lens is not None
        if kernel is not None:  # reads each request's blocks in place, only up to its own length
            out[:num_decode] = kernel(np.ascontiguousarray(q[:num_decode]), k_cache, v_cache, tables, context_lens,
                                      scale, window or 0)
        else:  # gathers every row's blocks and pads them to the longest context
            qd = q[:num_decode][:, :, None, :]  # [D, H, 1, d]
            kd, vd = _gather(k_cache, tables), _gather(v_cache, tables)  # [D, kv_heads, L, d]
            mask = meta.decode_mask(k_cache.shape[1], window)[:, None, :]  # [D, 1, L]
            out[:num_decode] = masked_attention(qd, kd, vd, mask, scale)[:, :, 0]
    block_size = k_cache.shape[1]
    chunk_kernel = paged_prefill_kernel() if meta.prefills and isinstance(prefill_kernel, str) else prefill_kernel
    if isinstance(chunk_kernel, str) or q.dtype != np.float32 or q.shape[-1] not in PREFILL_KERNEL_HEAD_DIMS:
        chunk_kernel = None
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        if chunk_kernel is not None:  # reads the chunk's keys and any cached ones from the cache in place
            out[rows] = chunk_kernel(np.ascontiguousarray(q[rows]), k_cache, v_cache, chunk.block_table,
                                     chunk.num_cached, scale, window or 0)
            continue
        qc = np.swapaxes(q[rows], 0, 1)  # [H, n, d]
        context = chunk.num_cached + chunk.num_tokens
        fits_window = window is None or context <= window
        if chunk.num_cached == 0 and fits_window:
            # Fresh prompt: its own keys are all the context, no need to read the cache back (but
            # rounded as the cache holds them, so a later hit on these blocks sees the same values).
            kc = np.swapaxes(k[rows].astype(k_cache.dtype).astype(np.float32), 0, 1)
            vc = np.swapaxes(v[rows].astype(v_cache.dtype).astype(np.float32), 0, 1)
            first = 0
        else:
            # The first block any query of the chunk can see: block 0 unless a window hides earlier ones.
            first = 0 if window is None else max(0, chunk.num_cached - window + 1) // block_size
            # up to the block holding the chunk's last key: a run of a chunk's rows (AttentionMetadata.rows)
            # keeps the whole chunk's table
            blocks = chunk.block_table[first:-(-context // block_size)]
            kc = _gather(k_cache, blocks)[:, : context - first * block_size]
            vc = _gather(v_cache, blocks)[:, : context - first * block_size]
        query_pos = np.arange(chunk.num_cached, context)[:, None]
        key_pos = np.arange(first * block_size, context)[None, :]
        mask = key_pos <= query_pos  # causal, offset by the cache
        if window is not None:
            mask &= key_pos > query_pos - window
        out[rows] = np.swapaxes(masked_attention(qc, kc, vc, mask, scale), 0, 1)
    return out
