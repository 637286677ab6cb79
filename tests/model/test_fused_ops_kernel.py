"""The fused layer ops (kernels/fused_ops.cpp) on numpy arrays, against float64 references and, where
the kernel rounds as separate fp32 ops do (rotary embedding, the residual add, the fp16 cache write),
against numpy's fp32 ops bit for bit."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conveyor.model.kernels import fused_ops


@pytest.fixture(scope="module")
def ops() -> Any:
    module = fused_ops()
    if module is None:
        pytest.skip("C++ kernels could not be built here (no compiler)")
    return module


def _rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def rms_norm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps) * weight.astype(np.float64)


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows: split across threads
def test_rms_norm_and_residual_add(ops: Any, rows: int) -> None:
    wide, weight = _rand(rows, 700) * 3, _rand(576, seed=1)
    x = wide[:, :576]  # rows with a stride, as a slice of a wider array
    np.testing.assert_allclose(ops.rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), rtol=1e-5, atol=1e-5)
    delta = _rand(rows, 576, seed=2)
    residual = x.copy()
    h = ops.add_rms_norm_(residual, delta, weight, 1e-5)
    assert np.array_equal(residual, x + delta)  # the residual stream is updated in place, exactly
    np.testing.assert_allclose(h, rms_norm_reference(x + delta, weight, 1e-5), rtol=1e-5, atol=1e-5)
    assert h.dtype == np.float32 and h.shape == (rows, 576)


def rope_reference(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                   slots: np.ndarray, heads: int, kv_heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """HF Llama's rotation in fp32 numpy ops (each product and sum rounded on its own), keys and values
    then stored into the caches at their slots (a float16 cache: rounded to nearest even)."""
    rows, d = qkv.shape[0], k_cache.shape[-1]

    def rotate(x: np.ndarray) -> np.ndarray:
        turned = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
        return x * cos[:, None] + turned * sin[:, None]

    q = rotate(qkv[:, : heads * d].reshape(rows, heads, d))
    k = rotate(qkv[:, heads * d : (heads + kv_heads) * d].reshape(rows, kv_heads, d))
    v = qkv[:, (heads + kv_heads) * d :].reshape(rows, kv_heads, d).copy()
    k_cache.reshape(-1, kv_heads, d)[slots] = k.astype(k_cache.dtype)
    v_cache.reshape(-1, kv_heads, d)[slots] = v.astype(v_cache.dtype)
    return q, k, v


def rope_inputs(head_dim: int, heads: int, kv_heads: int, rows: int, theta: float, seed: int) -> tuple[np.ndarray, ...]:
    qkv = _rand(rows, (heads + 2 * kv_heads) * head_dim, seed=seed) * 3
    positions = np.array([0, 5, 63, 1, 2, 3, 4, 30, 31, 32, 7][:rows], dtype=np.float32)
    inv = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)).astype(np.float32)
    angles = np.concatenate([positions[:, None] * inv[None]] * 2, axis=1).astype(np.float32)
    return qkv, np.cos(angles), np.sin(angles)


@pytest.mark.parametrize("cache_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (16, 4, 2), (128, 8, 8), (6, 2, 1)])
def test_rope_and_cache_matches_fp32_ops_bit_for_bit(ops: Any, head_dim: int, heads: int, kv_heads: int,
                                                     cache_dtype: type) -> None:
    """A float16 cache holds what astype(float16) makes (nearest even), head dims on and off the
    kernel's 8-wide conversion steps."""
    rows, block_size, blocks = 11, 4, 8
    qkv, cos, sin = rope_inputs(head_dim, heads, kv_heads, rows, 10000.0, seed=0)
    slots = np.random.default_rng(3).permutation(blocks * block_size)[:rows].astype(np.int64)
    caches = [np.zeros((blocks, block_size, kv_heads, head_dim), dtype=cache_dtype) for _ in range(4)]
    rows_in = qkv.copy()
    q, k, v = ops.rope_and_cache(rows_in, cos, sin, caches[0], caches[1], slots, heads, kv_heads, None, None, 1e-6)
    want = rope_reference(qkv, cos, sin, caches[2], caches[3], slots, heads, kv_heads)
    for got, expected in zip((q, k, v, caches[0], caches[1]), (*want, caches[2], caches[3])):
        assert got.shape == expected.shape and got.dtype == expected.dtype and np.array_equal(got, expected)
    assert q.flags.c_contiguous  # what the decode kernel reads
    assert np.shares_memory(k, rows_in) and np.shares_memory(v, rows_in), "k and v are views into qkv"


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(256, 4, 1), (128, 8, 4)])  # Gemma 3 270M, Qwen3-like
def test_rope_and_cache_with_qk_norms(ops: Any, head_dim: int, heads: int, kv_heads: int) -> None:
    """Per-head RMSNorm of q and k (Gemma 3, Qwen3) before the rotation, in the same pass: equal to the
    fp32 ops' within rounding (the norm's sum runs in another order); values copied exactly."""
    rows, block_size, blocks = 7, 4, 4
    qkv, cos, sin = rope_inputs(head_dim, heads, kv_heads, rows, 1_000_000.0, seed=4)
    slots = np.random.default_rng(4).permutation(blocks * block_size)[:rows].astype(np.int64)
    q_norm, k_norm = _rand(head_dim, seed=5) + 1, _rand(head_dim, seed=6) + 1
    caches = [np.zeros((blocks, block_size, kv_heads, head_dim), np.float32) for _ in range(4)]
    q, k, v = ops.rope_and_cache(qkv.copy(), cos, sin, caches[0], caches[1], slots, heads, kv_heads, q_norm, k_norm, 1e-6)
    normed = qkv.copy().reshape(rows, -1, head_dim)
    normed[:, :heads] = rms_norm_reference(normed[:, :heads], q_norm, 1e-6).astype(np.float32)
    normed[:, heads : heads + kv_heads] = rms_norm_reference(normed[:, heads : heads + kv_heads], k_norm, 1e-6)
    want = rope_reference(normed.reshape(rows, -1), cos, sin, caches[2], caches[3], slots, heads, kv_heads)
    for got, expected in zip((q, k, v, caches[0], caches[1]), (*want, caches[2], caches[3])):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.array_equal(v, want[2]) and np.array_equal(caches[1], caches[3])


def test_silu_and_mul(ops: Any) -> None:
    gate_up = _rand(33, 2 * 1536) * 8  # wide enough to reach exp's clamped range
    gate_up[0, :4] = [-100.0, 100.0, 0.0, -0.0]
    gate, up = gate_up[:, :1536].astype(np.float64), gate_up[:, 1536:].astype(np.float64)
    np.testing.assert_allclose(ops.silu_and_mul(gate_up), gate / (1 + np.exp(-gate)) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows,vocab", [(1, 262144), (7, 49152), (3, 37), (2, 1), (4, 33)])
def test_argmax_is_numpys_on_random_rows(ops: Any, rows: int, vocab: int) -> None:
    # 37, 33: lengths that end between vector steps; a wider array's column slice: strided rows
    logits = _rand(rows, vocab + 5)[:, :vocab]
    got = ops.argmax_rows(logits)
    assert got.dtype == np.int64 and np.array_equal(got, logits.argmax(axis=-1))


def test_argmax_ties_infinities_and_nans(ops: Any) -> None:
    """The first index of the maximum; a NaN beats every number, the first NaN wins (torch.argmax's and
    numpy.argmax's answer)."""
    nan, inf = float("nan"), float("inf")
    assert np.array_equal(ops.argmax_rows(np.full((2, 100), -inf, np.float32)), [0, 0])
    for row, where in (([1.0, 3.0, 3.0, 2.0], 1), ([0.0, nan, 5.0, nan], 1),
                       ([-0.0, 0.0, -1.0, -0.0], 0), ([inf, 1.0, inf, nan], 3), ([1.0, 2.0, inf, 3.0], 2)):
        for at in (0, 40, 123):  # the same pattern in the scalar tail and inside the vector steps
            logits = np.full((1, 160), -1e30, np.float32)
            logits[0, at : at + 4] = row
            assert int(ops.argmax_rows(logits)[0]) == at + where == int(logits.argmax()), (row, at)


def test_bad_inputs_raise_instead_of_writing_out_of_bounds(ops: Any) -> None:
    caches = [np.zeros((2, 4, 1, 8), np.float32) for _ in range(2)]
    cos, sin = np.ones((1, 8), np.float32), np.zeros((1, 8), np.float32)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.rope_and_cache(_rand(1, 24), cos, sin, *caches, np.array([8]), 1, 1, None, None, 1e-6)
    with pytest.raises(RuntimeError, match="row size"):
        ops.rope_and_cache(_rand(1, 32), cos, sin, *caches, np.array([0]), 1, 1, None, None, 1e-6)
    with pytest.raises(RuntimeError, match="int64 slot"):
        ops.rope_and_cache(_rand(1, 24), cos, sin, *caches, np.array([0], np.int32), 1, 1, None, None, 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(_rand(2, 8).astype(np.float64), np.ones(8, np.float32), 1e-6)
    with pytest.raises(RuntimeError, match="norm weight"):
        ops.rms_norm(_rand(2, 8), np.ones(9, np.float32), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.rms_norm(_rand(2, 16)[:, ::2], np.ones(8, np.float32), 1e-6)
    assert not any(c.any() for c in caches)
