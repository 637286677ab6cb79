"""The C++ paged decode kernel against the torch fallback (gather + padded SDPA)."""
from __future__ import annotations

import pytest
import torch

from conveyor.model.attention import AttentionMetadata, attend, write_kv
from conveyor.model.kernels import paged_decode_kernel


def _decode_batch(context_lens: list[int], block_size: int = 4, heads: int = 6, kv_heads: int = 2, head_dim: int = 16):
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # blocks scattered through the pool
    width = max(-(-c // block_size) for c in context_lens)
    tables, next_block = [], 0
    for c in context_lens:
        n = -(-c // block_size)
        own = order[next_block:next_block + n]
        next_block += n
        tables.append(own + [0] * (width - n))
    q = torch.randn(len(context_lens), heads, head_dim, generator=gen)
    return q, k_cache, v_cache, torch.tensor(tables), torch.tensor(context_lens)


def _reference(q, k_cache, v_cache, tables, lens, scale):
    """Each row on its own, its keys assembled token by token: no padding, no kernel."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    rows = []
    for i, c in enumerate(lens.tolist()):
        slots = [(tables[i, t // block_size].item(), t % block_size) for t in range(c)]
        k = torch.stack([k_cache[b, o] for b, o in slots]).repeat_interleave(heads // kv_heads, dim=1)  # [c, H, d]
        v = torch.stack([v_cache[b, o] for b, o in slots]).repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[i].double(), k.double()) * scale, dim=-1)
        rows.append(torch.einsum("ht,thd->hd", weights, v.double()).float())
    return torch.stack(rows)


@pytest.fixture(scope="module")
def kernel():
    fn = paged_decode_kernel()
    if fn is None:
        pytest.skip("C++ kernel could not be built here (no compiler/ninja)")
    return fn


# Fewer rows than two per thread cut each context into slices merged at the end (split-K): the
# long single rows below go through that path, the wider batches through one task per row, shared
# out by token count ([1000, 1, 1, 1]: one thread gets no task at all).
@pytest.mark.parametrize("context_lens", [[1], [5, 1, 17, 8], [64, 3, 33, 4, 4, 120], [300], [1000, 7], [130, 261, 9],
                                          [1000, 1, 1, 1]])
def test_kernel_matches_per_row_reference(kernel, context_lens):
    q, k_cache, v_cache, tables, lens = _decode_batch(context_lens)
    out = kernel(q, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, tables, lens, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])  # the compiled-in head sizes, not only the generic path
@pytest.mark.parametrize("context_lens", [[37], [5, 1, 17, 8, 300, 70], [16] * 9, [1500]])
def test_kernel_specialised_head_dims(kernel, context_lens, head_dim):
    q, k_cache, v_cache, tables, lens = _decode_batch(context_lens, block_size=16, heads=9, kv_heads=3, head_dim=head_dim)
    out = kernel(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, tables, lens, head_dim**-0.5), rtol=1e-5, atol=1e-5)


def test_kernel_and_fallback_agree_inside_attend(kernel, monkeypatch):
    q, k_cache, v_cache, tables, lens = _decode_batch([9, 30, 2, 16])
    slots = torch.tensor([tables[i, (c - 1) // 4].item() * 4 + (c - 1) % 4 for i, c in enumerate(lens.tolist())])
    new_k = k_cache.view(-1, *k_cache.shape[2:])[slots].clone()  # rewriting the last token in place: a no-op
    new_v = v_cache.view(-1, *v_cache.shape[2:])[slots].clone()

    def run() -> torch.Tensor:
        meta = AttentionMetadata(slots, 4, tables, lens, prefills=[])
        caches = k_cache.clone(), v_cache.clone()
        write_kv(*caches, new_k, new_v, slots)
        return attend(q, new_k, new_v, *caches, meta, 0.125)

    with_kernel = run()
    monkeypatch.setenv("CONVEYOR_KERNELS", "0")
    torch.testing.assert_close(with_kernel, run(), rtol=1e-5, atol=1e-5)


def test_kernel_rejects_a_context_longer_than_its_table(kernel):
    q, k_cache, v_cache, tables, lens = _decode_batch([8, 8])
    with pytest.raises(RuntimeError, match="context"):
        kernel(q, k_cache, v_cache, tables, torch.tensor([8, 9 + tables.shape[1] * 4]), 0.5)
