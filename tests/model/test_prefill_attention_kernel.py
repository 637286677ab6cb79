"""The C++ prefill attention kernel (paged_prefill.cpp) on numpy arrays against causal attention in
float64 over the same keys, and against the numpy reference it replaces inside `attend`."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conveyor.model.attention import AttentionMetadata, PrefillChunk, attend, write_kv
from conveyor.model.kernels import paged_prefill_kernel


@pytest.fixture(scope="module")
def kernel() -> Any:
    fn = paged_prefill_kernel()
    if fn is None:
        pytest.skip("C++ kernel could not be built here (no compiler)")
    return fn


def _chunk(num_cached: int, num_tokens: int, block_size: int, heads: int, kv_heads: int, d: int, seed: int = 0
           ) -> tuple[np.ndarray, ...]:
    """A cache holding positions 0 .. num_cached + num_tokens - 1 in shuffled blocks, plus spare
    blocks full of garbage (a kernel reading past its table would pick it up)."""
    rng = np.random.default_rng(seed)
    total = num_cached + num_tokens
    used = -(-total // block_size)
    num_blocks = used + 3
    k_cache = (rng.standard_normal((num_blocks, block_size, kv_heads, d)) * 50).astype(np.float32)
    v_cache = (rng.standard_normal((num_blocks, block_size, kv_heads, d)) * 50).astype(np.float32)
    table = rng.permutation(num_blocks)[:used].astype(np.int64)
    keys = rng.standard_normal((total, kv_heads, d)).astype(np.float32)
    values = rng.standard_normal((total, kv_heads, d)).astype(np.float32)
    slots = table[np.arange(total) // block_size] * block_size + np.arange(total) % block_size
    k_cache.reshape(-1, kv_heads, d)[slots] = keys
    v_cache.reshape(-1, kv_heads, d)[slots] = values
    q = rng.standard_normal((num_tokens, heads, d)).astype(np.float32)
    return q, k_cache, v_cache, table, keys, values, slots


def _reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, num_cached: int, scale: float,
               window: int = 0) -> np.ndarray:
    """Every query on its own in float64 over the positions it sees."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    k = keys.astype(np.float64).repeat(heads // kv_heads, axis=1)
    v = values.astype(np.float64).repeat(heads // kv_heads, axis=1)
    rows = []
    for i in range(q.shape[0]):
        pos = num_cached + i
        first = max(0, pos - window + 1) if window else 0
        scores = np.einsum("hd,thd->ht", q[i].astype(np.float64), k[first:pos + 1]) * scale
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        rows.append(np.einsum("ht,thd->hd", weights, v[first:pos + 1]))
    return np.stack(rows)


def assert_close(got: np.ndarray, want: np.ndarray, tolerance: float = 2e-5) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


# Fresh prompts and cache hits, lengths on and off the 16-key steps and the blocks, tiles of one
# to sixteen rows (AVX-512: 3 query heads per KV head, 5 positions a tile; 1: 16; 4: 4; 32: two parts
# of 16).
@pytest.mark.parametrize("num_cached, num_tokens", [(0, 1), (0, 5), (0, 16), (0, 33), (0, 200), (16, 16), (7, 1),
                                                    (1024, 32), (45, 70), (300, 3)])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 2), (32, 1)])
def test_kernel_matches_causal_attention(kernel, num_cached, num_tokens, heads, kv_heads):
    q, k_cache, v_cache, table, keys, values, _ = _chunk(num_cached, num_tokens, 16, heads, kv_heads, 64)
    out = kernel(q, k_cache, v_cache, table, num_cached, 0.125, 0)
    assert_close(out, _reference(q, keys, values, num_cached, 0.125))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_head_dims_and_block_sizes(kernel, d, block_size):
    q, k_cache, v_cache, table, keys, values, _ = _chunk(21, 40, block_size, 6, 2, d, seed=d + block_size)
    out = kernel(q, k_cache, v_cache, table, 21, d**-0.5, 0)
    assert_close(out, _reference(q, keys, values, 21, d**-0.5))
    # a table of int32 block ids is read as int64 (converted, as torch's .to(kLong) did)
    assert np.array_equal(out, kernel(q, k_cache, v_cache, table.astype(np.int32), 21, d**-0.5, 0))


# Windows of one position, inside a step, on a step's edge, across the cached part, longer than
# everything (no effect); chunks that start before and after the window's reach.
@pytest.mark.parametrize("window", [1, 3, 16, 17, 40, 5000])
@pytest.mark.parametrize("num_cached, num_tokens", [(0, 50), (30, 20), (100, 7), (5, 1)])
def test_sliding_window(kernel, window, num_cached, num_tokens):
    q, k_cache, v_cache, table, keys, values, _ = _chunk(num_cached, num_tokens, 16, 4, 1, 256, seed=window)
    out = kernel(q, k_cache, v_cache, table, num_cached, 0.0625, window)
    assert_close(out, _reference(q, keys, values, num_cached, 0.0625, window))


def test_large_scores_stay_finite(kernel):
    """Scores of hundreds: the running max keeps every exp in range (a plain softmax would overflow)."""
    q, k_cache, v_cache, table, keys, values, _ = _chunk(40, 60, 16, 9, 3, 64)
    q = q * 30
    out = kernel(q, k_cache, v_cache, table, 40, 1.0, 0)
    assert np.isfinite(out).all()
    # fp32 scores of ~500 carry ~1e-4 of rounding, which the exp passes on to the weights.
    assert_close(out, _reference(q, keys, values, 40, 1.0), tolerance=1e-3)


@pytest.mark.parametrize("window", [None, 24])
def test_kernel_and_the_reference_agree_inside_attend(kernel, monkeypatch, window):
    """A step of two prefill chunks (a fresh prompt, then a cache hit) beside two decode rows."""
    rng = np.random.default_rng(3)
    block_size, heads, kv_heads, d = 16, 9, 3, 64
    k_cache = rng.standard_normal((40, block_size, kv_heads, d), dtype=np.float32)
    v_cache = rng.standard_normal((40, block_size, kv_heads, d), dtype=np.float32)
    fresh_table, hit_table = np.array([3, 9, 1]), np.array([20, 21, 22, 23, 5])
    decode_tables, decode_lens = np.array([[30, 31], [32, 0]]), np.array([20, 7])
    fresh_slots = fresh_table[np.arange(37) // block_size] * block_size + np.arange(37) % block_size
    hit_pos = np.arange(50, 70)
    hit_slots = hit_table[hit_pos // block_size] * block_size + hit_pos % block_size
    decode_slots = np.array([31 * block_size + 3, 32 * block_size + 6])
    slots = np.concatenate([decode_slots, fresh_slots, hit_slots])
    q = rng.standard_normal((len(slots), heads, d), dtype=np.float32)
    new_k = rng.standard_normal((len(slots), kv_heads, d), dtype=np.float32)
    new_v = rng.standard_normal((len(slots), kv_heads, d), dtype=np.float32)
    chunks = [PrefillChunk(2, 37, 0, fresh_table), PrefillChunk(39, 20, 50, hit_table)]

    def run() -> np.ndarray:
        caches = k_cache.copy(), v_cache.copy()
        write_kv(*caches, new_k, new_v, slots)
        meta = AttentionMetadata(slots, 2, decode_tables, decode_lens, prefills=chunks)
        return attend(q, new_k, new_v, *caches, meta, 0.125, window=window)

    with_kernel = run()
    monkeypatch.setenv("CONVEYOR_PREFILL_ATTENTION", "0")
    assert_close(run(), with_kernel)


def test_bad_arguments_are_refused(kernel):
    q, k_cache, v_cache, table, *_ = _chunk(10, 10, 16, 4, 2, 64)
    with pytest.raises(RuntimeError, match="block table too short"):
        kernel(q, k_cache, v_cache, table[:1], 10, 0.1, 0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(q, k_cache, v_cache, np.array([0, 99]), 10, 0.1, 0)
    with pytest.raises(RuntimeError, match="heads"):
        kernel(q[:, :3], k_cache, v_cache, table, 10, 0.1, 0)
    with pytest.raises(RuntimeError, match="head dim"):
        kernel(q[..., :60], k_cache[..., :60].copy(), v_cache[..., :60].copy(), table, 10, 0.1, 0)
    with pytest.raises(RuntimeError, match="no conversion"):
        kernel(q, k_cache, v_cache, table.astype(np.float16), 10, 0.1, 0)


# A float16 cache is widened to fp32 as the kernel copies it out of the blocks: the result is causal
# attention over the stored halves, in float64 here.
@pytest.mark.parametrize("num_cached, num_tokens, window", [(0, 33, 0), (45, 70, 0), (300, 3, 0), (30, 20, 16)])
@pytest.mark.parametrize("d, heads, kv_heads", [(64, 9, 3), (128, 8, 2), (256, 4, 1)])
def test_float16_cache(kernel, num_cached, num_tokens, window, d, heads, kv_heads):
    q, k_cache, v_cache, table, keys, values, _ = _chunk(num_cached, num_tokens, 16, heads, kv_heads, d)
    k_half, v_half = k_cache.astype(np.float16), v_cache.astype(np.float16)
    out = kernel(q, k_half, v_half, table, num_cached, d**-0.5, window)
    want = _reference(q, keys.astype(np.float16), values.astype(np.float16), num_cached, d**-0.5, window)
    assert_close(out, want)
    with pytest.raises(RuntimeError, match="fp32 or fp16"):
        kernel(q, k_half, v_cache, table, num_cached, d**-0.5, window)


@pytest.mark.parametrize("window", [0, 40, 100])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 1), (14, 2)])  # 5, 4 and 2 positions a tile (AVX-512)
def test_a_chunk_cut_anywhere_gives_the_same_bits(kernel, window, heads, kv_heads):
    # What a layer's runs of rows do (llama.row_runs): the chunk's rows in parts, each after the keys
    # of the parts before it. A query's result depends only on its position, so the parts' outputs
    # are the whole chunk's, bit for bit, wherever the cuts fall (off the steps of 16 and 8 keys).
    num_cached, num_tokens = 37, 230
    q, k_cache, v_cache, table, keys, values, _ = _chunk(num_cached, num_tokens, 16, heads, kv_heads, 64, seed=window)
    whole = kernel(q, k_cache, v_cache, table, num_cached, 0.125, window)
    for cuts in ([0, 1, 230], [0, 19, 37, 101, 230], [0, 7, 64, 65, 199, 230]):
        parts = [kernel(np.ascontiguousarray(q[a:b]), k_cache, v_cache, table, num_cached + a, 0.125, window)
                 for a, b in zip(cuts, cuts[1:])]
        assert np.array_equal(np.concatenate(parts), whole)
    assert_close(whole, _reference(q, keys, values, num_cached, 0.125, window))


def test_a_window_reads_nothing_before_its_first_visible_key(kernel):
    # A sliding window's pool may have handed the blocks before the window to another request: NaN
    # there must not reach any output, though the kernel's steps of keys start below the window.
    num_cached, num_tokens, window = 200, 50, 64
    q, k_cache, v_cache, table, keys, values, slots = _chunk(num_cached, num_tokens, 16, 4, 1, 64, seed=3)
    first_seen = num_cached - window + 1
    k_cache.reshape(-1, 1, 64)[slots[:first_seen]] = np.nan
    v_cache.reshape(-1, 1, 64)[slots[:first_seen]] = np.nan
    out = kernel(q, k_cache, v_cache, table, num_cached, 0.125, window)
    assert np.isfinite(out).all()
    assert_close(out, _reference(q, keys, values, num_cached, 0.125, window))
