"""Attention over a paged KV cache.

The cache of one layer is a pair of tensors [num_blocks, block_size, kv_heads, head_dim]. New keys
and values are scattered into it through a flat slot mapping; queries read their context back
through block tables. Single-query rows (decodes) are attended in one batched call (a C++ kernel
that reads the blocks in place, or gather + SDPA as the fallback); multi-token prefill chunks,
which are few and large, one call each (a C++ kernel that reads the blocks in place, or SDPA).

A sliding-window layer (Gemma's local layers) passes `window`: a query at position p then sees
positions p - window + 1 .. p only (as HF's sliding mask: key > query - window), and only the
blocks holding those positions are read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from conveyor.model.kernels import PagedDecodeKernel, PagedPrefillKernel, paged_decode_kernel, paged_prefill_kernel


@dataclass
class PrefillChunk:
    token_start: int  # first row of this chunk in the flat batch
    num_tokens: int
    num_cached: int  # tokens of this request already in the cache before the chunk
    block_table: torch.Tensor  # [blocks covering num_cached + num_tokens]


@dataclass
class AttentionMetadata:
    """Built once per step by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of each new token
    num_decode_tokens: int  # the first rows of the batch are single-query requests
    decode_block_tables: torch.Tensor | None  # [D, max_blocks], int64, padded with block 0
    decode_context_lens: torch.Tensor | None  # [D], int64: tokens each decode row attends to
    prefills: list[PrefillChunk]
    # Rows [start, end) that compute prompt tokens (the rest compute generated ones): where the
    # products take prompt tokens on their own kernel (linear.PromptRows), these are they.
    prompt_rows: tuple[tuple[int, int], ...] = ()
    # The same step in the sliding-window layers' own KV pool (slots and tables; the runner's
    # kv_window), None where those layers share the others' pool.
    window_group: AttentionMetadata | None = None
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    def decode_mask(self, block_size: int, window: int | None = None) -> torch.Tensor:
        """[D, 1, 1, max_blocks * block_size], True where a key is visible (the torch fallback's
        padding and, with `window`, the positions before each row's window). One per window size."""
        if window not in self._decode_masks:
            assert self.decode_block_tables is not None and self.decode_context_lens is not None
            width = self.decode_block_tables.shape[1] * block_size
            keys, lens = torch.arange(width)[None, :], self.decode_context_lens[:, None]
            visible = keys < lens
            if window is not None:
                visible &= keys >= lens - window
            self._decode_masks[window] = visible[:, None, None, :]
        return self._decode_masks[window]


# The prefill kernel's compiled-in head sizes (others take SDPA).
PREFILL_KERNEL_HEAD_DIMS = (64, 128, 256)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, kv_heads, d] into the cache slots, in the cache's dtype (rounded to nearest even)."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., blocks] block ids -> [..., kv_heads, blocks * block_size, head_dim] in `dtype` (the queries')."""
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    # index_select on whole blocks as rows: several times faster than advanced indexing on CPU.
    rows = cache.view(num_blocks, -1).index_select(0, block_tables.flatten()).to(dtype)
    flat = rows.view(*block_tables.shape[:-1], block_tables.shape[-1] * block_size, kv_heads, head_dim)
    return flat.transpose(-3, -2)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode_kernel: PagedDecodeKernel | None | Literal["resolve"] = "resolve",
    window: int | None = None,
    prefill_kernel: PagedPrefillKernel | None | Literal["resolve"] = "resolve",
) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d] for the new tokens, already written into the cache
    at meta.slot_mapping (write_kv, or the fused rope_and_cache). Returns [T, heads, d].
    `decode_kernel`: paged_decode_kernel() as the caller resolved it once per forward pass (None:
    the torch fallback), or "resolve" to look it up here; `prefill_kernel` likewise, from
    paged_prefill_kernel(), for the prefill chunks. `window`: a sliding window's size (None: all)."""
    num_decode = meta.num_decode_tokens
    if isinstance(decode_kernel, str):
        decode_kernel = paged_decode_kernel()
    kernel = decode_kernel if num_decode and q.dtype == torch.float32 else None
    tables, context_lens = meta.decode_block_tables, meta.decode_context_lens
    if kernel is not None and num_decode == q.shape[0]:  # a pure decode step: the kernel's output is all of it
        assert tables is not None and context_lens is not None  # build_inputs sets both for decode rows
        return kernel(q.contiguous(), k_cache, v_cache, tables, context_lens, scale, window or 0)
    out = torch.empty_like(q)
    if num_decode:
        assert tables is not None and context_lens is not None
        if kernel is not None:  # reads each request's blocks in place, only up to its own length
            out[:num_decode] = kernel(q[:num_decode].contiguous(), k_cache, v_cache, tables, context_lens, scale,
                                      window or 0)
        else:  # gathers every row's blocks and pads them to the longest context
            qd = q[:num_decode].unsqueeze(2)  # [D, H, 1, d]
            kd = _gather(k_cache, tables, q.dtype)
            vd = _gather(v_cache, tables, q.dtype)
            mask = meta.decode_mask(k_cache.shape[1], window)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=True)
            out[:num_decode] = od.squeeze(2)
    block_size = k_cache.shape[1]
    chunk_kernel = paged_prefill_kernel() if meta.prefills and isinstance(prefill_kernel, str) else prefill_kernel
    if isinstance(chunk_kernel, str) or q.dtype != torch.float32 or q.shape[-1] not in PREFILL_KERNEL_HEAD_DIMS:
        chunk_kernel = None
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        if chunk_kernel is not None:  # reads the chunk's keys and any cached ones from the cache in place
            out[rows] = chunk_kernel(q[rows], k_cache, v_cache, chunk.block_table, chunk.num_cached, scale, window or 0)
            continue
        qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        fits_window = window is None or chunk.num_cached + chunk.num_tokens <= window
        if chunk.num_cached == 0 and fits_window:
            # Fresh prompt: its own keys are all the context, no need to read the cache back (but
            # rounded as the cache holds them, so a later hit on these blocks sees the same values).
            kc = k[rows].to(k_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
            vc = v[rows].to(v_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
            oc = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True)
        else:
            context = chunk.num_cached + chunk.num_tokens
            # The first block any query of the chunk can see: block 0 unless a window hides earlier ones.
            first = 0 if window is None else max(0, chunk.num_cached - window + 1) // block_size
            kc = _gather(k_cache, chunk.block_table[first:], q.dtype)[:, : context - first * block_size].unsqueeze(0)
            vc = _gather(v_cache, chunk.block_table[first:], q.dtype)[:, : context - first * block_size].unsqueeze(0)
            query_pos = torch.arange(chunk.num_cached, context).unsqueeze(1)
            key_pos = torch.arange(first * block_size, context).unsqueeze(0)
            mask = key_pos <= query_pos  # causal, offset by the cache
            if window is not None:
                mask &= key_pos > query_pos - window
            oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = oc.squeeze(0).transpose(0, 1)
    return out
