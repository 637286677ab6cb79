"""The C++ paged decode kernel (paged_decode.cpp) on numpy arrays against each row's softmax in
float64, and against the numpy fallback (gather + a padded, masked softmax) inside `attend`."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conveyor.model.attention import AttentionMetadata, PrefillChunk, attend, write_kv
from conveyor.model.kernels import paged_decode_kernel


def _decode_batch(context_lens: list[int], block_size: int = 4, heads: int = 6, kv_heads: int = 2, head_dim: int = 16
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    k_cache = rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    order = rng.permutation(num_blocks).tolist()  # blocks scattered through the pool
    width = max(-(-c // block_size) for c in context_lens)
    tables, next_block = [], 0
    for c in context_lens:
        n = -(-c // block_size)
        own = order[next_block:next_block + n]
        next_block += n
        tables.append(own + [0] * (width - n))
    q = rng.standard_normal((len(context_lens), heads, head_dim)).astype(np.float32)
    return q, k_cache, v_cache, np.array(tables, dtype=np.int64), np.array(context_lens, dtype=np.int64)


def _reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, tables: np.ndarray, lens: np.ndarray,
               scale: float, window: int | None = None) -> np.ndarray:
    """Each row on its own, its keys assembled token by token: no padding, no kernel. `window`:
    only the row's last `window` tokens."""
    heads, kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    rows = []
    for i, c in enumerate(lens.tolist()):
        first = 0 if window is None else max(0, c - window)
        slots = [(int(tables[i, t // block_size]), t % block_size) for t in range(first, c)]
        k = np.stack([k_cache[b, o] for b, o in slots]).astype(np.float64).repeat(heads // kv_heads, axis=1)  # [c, H, d]
        v = np.stack([v_cache[b, o] for b, o in slots]).astype(np.float64).repeat(heads // kv_heads, axis=1)
        scores = np.einsum("hd,thd->ht", q[i].astype(np.float64), k) * scale
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        rows.append(np.einsum("ht,thd->hd", weights, v))
    return np.stack(rows)


def assert_close(got: np.ndarray, want: np.ndarray, tolerance: float = 1e-5) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


@pytest.fixture(scope="module")
def kernel() -> Any:
    fn = paged_decode_kernel()
    if fn is None:
        pytest.skip("C++ kernel could not be built here (no compiler)")
    return fn


# Fewer rows than two per thread cut each context into slices merged at the end (split-K): the
# long single rows below go through that path, the wider batches through one task per row, shared
# out by token count ([1000, 1, 1, 1]: one thread gets no task at all).
@pytest.mark.parametrize("context_lens", [[1], [5, 1, 17, 8], [64, 3, 33, 4, 4, 120], [300], [1000, 7], [130, 261, 9],
                                          [1000, 1, 1, 1]])
def test_kernel_matches_per_row_reference(kernel, context_lens):
    q, k_cache, v_cache, tables, lens = _decode_batch(context_lens)
    assert_close(kernel(q, k_cache, v_cache, tables, lens, 0.25), _reference(q, k_cache, v_cache, tables, lens, 0.25))


@pytest.mark.parametrize("head_dim", [64, 128])  # the compiled-in head sizes, not only the generic path
@pytest.mark.parametrize("context_lens", [[37], [5, 1, 17, 8, 300, 70], [16] * 9, [1500]])
def test_kernel_specialised_head_dims(kernel, context_lens, head_dim):
    q, k_cache, v_cache, tables, lens = _decode_batch(context_lens, block_size=16, heads=9, kv_heads=3, head_dim=head_dim)
    out = kernel(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert_close(out, _reference(q, k_cache, v_cache, tables, lens, head_dim**-0.5))


# Windows that start inside a block, on a block boundary, before the first token (no effect), and
# of one token; rows long enough to be sliced (split-K) and batches wide enough for a task per row.
@pytest.mark.parametrize("window", [1, 4, 7, 16, 50, 2000])
@pytest.mark.parametrize("context_lens", [[1], [300], [1000, 7], [5, 1, 17, 8, 300, 70], [64, 3, 33, 4, 4, 120]])
def test_kernel_sliding_window(kernel, context_lens, window):
    q, k_cache, v_cache, tables, lens = _decode_batch(context_lens, heads=4, kv_heads=1, head_dim=256)
    out = kernel(q, k_cache, v_cache, tables, lens, 0.0625, window)
    assert_close(out, _reference(q, k_cache, v_cache, tables, lens, 0.0625, window))


def _last_slots(tables: np.ndarray, lens: np.ndarray) -> np.ndarray:
    return np.array([int(tables[i, (c - 1) // 4]) * 4 + (c - 1) % 4 for i, c in enumerate(lens.tolist())])


@pytest.mark.parametrize("window", [None, 5])
def test_kernel_and_fallback_agree_inside_attend(kernel, monkeypatch, window):
    q, k_cache, v_cache, tables, lens = _decode_batch([9, 30, 2, 16])
    slots = _last_slots(tables, lens)
    new_k = k_cache.reshape(-1, *k_cache.shape[2:])[slots].copy()  # rewriting the last token in place: a no-op
    new_v = v_cache.reshape(-1, *v_cache.shape[2:])[slots].copy()

    def run() -> np.ndarray:
        meta = AttentionMetadata(slots, 4, tables, lens, prefills=[])
        caches = k_cache.copy(), v_cache.copy()
        write_kv(*caches, new_k, new_v, slots)
        return attend(q, new_k, new_v, *caches, meta, 0.125, window=window)

    with_kernel = run()
    assert_close(with_kernel, _reference(q, k_cache, v_cache, tables, lens, 0.125, window))
    monkeypatch.setenv("CONVEYOR_KERNELS", "0")
    assert_close(run(), with_kernel)


@pytest.mark.parametrize("window", [3, 8, 13])
@pytest.mark.parametrize("num_cached, num_tokens", [(0, 20), (0, 5), (6, 9), (16, 4), (11, 17)])
def test_prefill_chunk_sliding_window(num_cached, num_tokens, window):
    """A prefill chunk on a local layer against full causal attention masked to the window."""
    rng = np.random.default_rng(1)
    block_size, heads, kv_heads, d = 4, 4, 2, 8
    total = num_cached + num_tokens
    num_blocks = -(-total // block_size) + 2
    k_cache = np.zeros((num_blocks, block_size, kv_heads, d), dtype=np.float32)
    v_cache = np.zeros((num_blocks, block_size, kv_heads, d), dtype=np.float32)
    table = rng.permutation(num_blocks)[: -(-total // block_size)]
    keys = rng.standard_normal((total, kv_heads, d), dtype=np.float32)
    values = rng.standard_normal((total, kv_heads, d), dtype=np.float32)
    slots = table[np.arange(total) // block_size] * block_size + np.arange(total) % block_size
    write_kv(k_cache, v_cache, keys, values, slots)  # the cached part and the chunk's own tokens
    q = rng.standard_normal((num_tokens, heads, d), dtype=np.float32)
    meta = AttentionMetadata(slots[num_cached:], 0, None, None, [PrefillChunk(0, num_tokens, num_cached, table)])
    out = attend(q, keys[num_cached:], values[num_cached:], k_cache, v_cache, meta, 0.3, window=window)
    # full causal attention masked to the window, in float64; query head h reads KV head h // 2
    query_pos, key_pos = np.arange(num_cached, total)[:, None], np.arange(total)[None, :]
    mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
    k64 = keys.astype(np.float64).repeat(heads // kv_heads, axis=1)
    scores = np.einsum("nhd,thd->hnt", q.astype(np.float64), k64) * 0.3
    scores = np.where(mask[None], scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    expected = np.einsum("hnt,thd->nhd", weights, values.astype(np.float64).repeat(heads // kv_heads, axis=1))
    assert_close(out, expected)


def test_kernel_rejects_a_context_longer_than_its_table(kernel):
    q, k_cache, v_cache, tables, lens = _decode_batch([8, 8])
    with pytest.raises(RuntimeError, match="context"):
        kernel(q, k_cache, v_cache, tables, np.array([8, 9 + tables.shape[1] * 4]), 0.5)


# Rows whose first block another row holds (prefix-cache hits) take the register-blocked span, the
# others the token-by-token one (or, on CPUs where it is faster, the register-blocked one too): a
# row's output must not depend on which, or caching would change outputs. The same rows, once
# sharing their prefix blocks and once holding copies of them, those run by either span.
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 9, 3), (128, 8, 2), (256, 4, 1), (16, 6, 2)])
@pytest.mark.parametrize("context_lens, window", [([40, 75], 0), ([300, 290, 37, 64, 100, 18], 0), ([300, 290], 50),
                                                  ([1000, 990, 33, 800], 0)])
def test_shared_and_copied_prefix_blocks_give_identical_outputs(kernel, head_dim, heads, kv_heads, context_lens, window):
    rng = np.random.default_rng(2)
    block_size, prefix_blocks = 16, 2
    copies = [-(-c // block_size) for c in context_lens]  # every row with its own copy of everything
    num_blocks = sum(copies)
    k_cache = rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    width = max(copies)
    own_tables, shared_tables, start = [], [], 0
    for row, n in enumerate(copies):
        own = list(range(start, start + n))
        start += n
        if row > 0:  # row 0's first blocks, copied into this row's own
            k_cache[own[:prefix_blocks]] = k_cache[:prefix_blocks]
            v_cache[own[:prefix_blocks]] = v_cache[:prefix_blocks]
        own_tables.append(own + [0] * (width - n))
        shared_tables.append(list(range(prefix_blocks)) + own[prefix_blocks:] + [0] * (width - n))
    q = rng.standard_normal((len(context_lens), heads, head_dim)).astype(np.float32)
    lens, scale = np.array(context_lens), head_dim**-0.5
    shared = kernel(q, k_cache, v_cache, np.array(shared_tables), lens, scale, window)
    for unshared_span in ("token", "vector", "auto"):
        copied = kernel(q, k_cache, v_cache, np.array(own_tables), lens, scale, window, unshared_span=unshared_span)
        assert np.array_equal(shared, copied), unshared_span
    assert_close(shared, _reference(q, k_cache, v_cache, np.array(own_tables), lens, scale, window or None))


# A float16 cache: the kernel reads the stored halves into fp32, so its output is the reference's over
# the same (exactly representable) values. Rows of their own blocks (the token walk), rows sharing
# their first blocks (the register-blocked span), sliced long rows, windows, compiled-in and generic
# head dims.
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 9, 3), (128, 8, 2), (256, 4, 1), (16, 6, 2), (24, 2, 1)])
@pytest.mark.parametrize("context_lens, window, share", [([1], 0, False), ([5, 1, 17, 8], 0, False), ([1000, 7], 0, False),
                                                         ([300, 290, 37], 0, True), ([300, 290], 50, True),
                                                         ([64, 3, 33, 4, 4, 120], 7, False)])
def test_float16_cache_matches_reference(kernel, head_dim, heads, kv_heads, context_lens, window, share):
    q, k_cache, v_cache, tables, lens = _decode_batch(context_lens, block_size=16, heads=heads, kv_heads=kv_heads,
                                                      head_dim=head_dim)
    if share:  # every row starts with row 0's first block
        tables[1:, 0] = tables[0, 0]
    k_cache, v_cache = k_cache.astype(np.float16), v_cache.astype(np.float16)
    scale = head_dim**-0.5
    out = kernel(q, k_cache, v_cache, tables, lens, scale, window)
    assert_close(out, _reference(q, k_cache, v_cache, tables, lens, scale, window or None))
    for unshared_span in ("token", "vector"):  # whichever span this CPU runs rows of their own on
        assert np.array_equal(out, kernel(q, k_cache, v_cache, tables, lens, scale, window, unshared_span=unshared_span))
    # the same values held in fp32 give the same result (only the reads differ)
    widened = kernel(q, k_cache.astype(np.float32), v_cache.astype(np.float32), tables, lens, scale, window)
    np.testing.assert_allclose(out, widened, rtol=1e-6, atol=1e-6)


def test_kernel_refuses_an_unknown_span(kernel):
    q, k_cache, v_cache, tables, lens = _decode_batch([8, 3])
    with pytest.raises(RuntimeError, match="unshared_span must be auto, token or vector"):
        kernel(q, k_cache, v_cache, tables, lens, 0.5, 0, unshared_span="tiles")


def test_kernel_refuses_mixed_or_other_caches(kernel):
    q, k_cache, v_cache, tables, lens = _decode_batch([8, 3])
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(q, k_cache.astype(np.float16), v_cache, tables, lens, 0.5)
    with pytest.raises(RuntimeError, match="float32 or float16"):
        kernel(q, k_cache.astype(np.float64), v_cache.astype(np.float64), tables, lens, 0.5)
    with pytest.raises(RuntimeError, match="int64 tables"):
        kernel(q, k_cache, v_cache, tables.astype(np.int32), lens, 0.5)


@pytest.mark.parametrize("window", [None, 5])
def test_float16_cache_kernel_and_fallback_agree_inside_attend(kernel, monkeypatch, window):
    """write_kv rounds new keys and values into a float16 cache; attend's kernel and its numpy fallback
    (which widens the gathered blocks to fp32) then read the same values."""
    q, k_cache, v_cache, tables, lens = _decode_batch([9, 30, 2, 16])
    k_cache, v_cache = k_cache.astype(np.float16), v_cache.astype(np.float16)
    slots = _last_slots(tables, lens)
    rng = np.random.default_rng(2)
    new_k, new_v = rng.standard_normal((4, 2, 16), dtype=np.float32), rng.standard_normal((4, 2, 16), dtype=np.float32)

    def run() -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        meta = AttentionMetadata(slots, 4, tables, lens, prefills=[])
        caches = k_cache.copy(), v_cache.copy()
        write_kv(*caches, new_k, new_v, slots)
        return attend(q, new_k, new_v, *caches, meta, 0.125, window=window), caches

    with_kernel, caches = run()
    assert caches[0].dtype == np.float16
    assert np.array_equal(caches[0].reshape(-1, 2, 16)[slots], new_k.astype(np.float16))
    assert_close(with_kernel, _reference(q, *caches, tables, lens, 0.125, window))
    monkeypatch.setenv("CONVEYOR_KERNELS", "0")
    assert_close(run()[0], with_kernel)


def test_write_kv_refuses_a_cache_it_would_copy() -> None:
    k_cache = np.zeros((4, 16, 2, 8), dtype=np.float16)
    strided = np.zeros((4, 16, 2, 16), dtype=np.float16)[..., ::2]  # reshape would copy it
    k = np.ones((3, 2, 8), dtype=np.float32)
    slots = np.array([0, 1, 17])
    with pytest.raises(ValueError, match="contiguous"):
        write_kv(strided, k_cache, k, k, slots)
    v_cache = np.zeros_like(k_cache)
    write_kv(k_cache, v_cache, k, 2 * k, slots)
    assert k_cache.reshape(-1, 2, 8)[17].tolist() == [[1.0] * 8] * 2 and v_cache.reshape(-1, 2, 8)[1, 0, 0] == 2
