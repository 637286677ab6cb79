"""The matmul kernels on numpy arrays: quant_gemm.cpp on GGUF blocks (Q4_0-Q8_0, Q2_K-Q6_K) and 16-bit
floats (F16, BF16) against gguf-py's dequantiser and bit for bit against panel_gemm.cpp's fp32 panels;
both against float64 products; the row lookup, column norms, packing into a run of panels, and the
screened Q8_0 argmax against the full product's."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conveyor.model.kernels import panel_gemm, quant_gemm

from .kernel_blocks import (KERNEL_QTYPE, KERNEL_TYPES, KERNEL_UNIT_K, PANEL_UNIT_BYTES, in_features, random_blocks,
                            reference_fp32)

pytestmark = pytest.mark.skipif(quant_gemm() is None or panel_gemm() is None, reason="kernels not built here")
QG: Any = quant_gemm()
PG: Any = panel_gemm()

# Rows through the in-register tiles (1-10: one tile with AVX-512, one or two on AVX2), the L2 buffer
# (11+) and two row blocks of it (131).
ROWS = [1, 2, 3, 4, 5, 7, 10, 11, 13, 24, 25, 33, 131]


def randn(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def float64_product(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    y = x.astype(np.float64) @ weight.astype(np.float64).T
    return y + bias if bias is not None else y


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_each_weight_expands_to_gguf_s_value_exactly(qtype: str) -> None:
    """One-hot rows read single weights out of the kernel (1 * w + 0 * ... is w exactly), through
    every path (the identity's 11+ rows take the L2 buffer, slices of it the in-register tiles),
    on blocks with any finite fp16 scales."""
    k = in_features(qtype)
    blocks = random_blocks(qtype, 40, k, seed=1, wild=True)
    weight = reference_fp32(qtype, blocks)
    assert np.isfinite(weight).all()
    packed = QG.pack_quantized(blocks, KERNEL_QTYPE[qtype])
    eye = np.eye(k, dtype=np.float32)
    assert np.array_equal(QG.quantized_matmul(eye, packed, 40, None, KERNEL_QTYPE[qtype]).T, weight)
    for start, rows in ((0, 1), (5, 3), (k - 5, 5), (17, 7)):
        read = QG.quantized_matmul(eye[start : start + rows], packed, 40, None, KERNEL_QTYPE[qtype])
        assert np.array_equal(read.T, weight[:, start : start + rows])


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
# 40: the last panel holds 8 real columns; 136: 9 panels, split over the threads unevenly, with
# the partial one at the end of the second thread's run
@pytest.mark.parametrize("out_features", [48, 40, 136])
def test_blocks_give_the_fp32_panels_products_bit_for_bit(qtype: str, out_features: int) -> None:
    k, code = in_features(qtype), KERNEL_QTYPE[qtype]
    blocks = random_blocks(qtype, out_features, k)
    weight = reference_fp32(qtype, blocks)
    packed, dense = QG.pack_quantized(blocks, code), PG.pack_panels(weight)
    bias = randn(out_features, seed=1)
    for rows in ROWS:
        x = randn(rows, k + 3, seed=rows)[:, :k]  # rows a stride apart
        for b in (None, bias):
            got = QG.quantized_matmul(x, packed, out_features, b, code)
            assert got.dtype == np.float32 and got.shape == (rows, out_features)
            assert np.array_equal(got, PG.panel_matmul(x, dense, out_features, b)), rows
            want = float64_product(x, weight, b)
            bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(weight).T).max()  # fp32 rounding of a length-k sum
            assert (np.abs(got - want) <= 1e-5 * np.abs(want) + bound).all(), rows


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_large_k_products_in_fused_tiles_give_the_fp32_products_bit_for_bit(qtype: str) -> None:
    """From K = 2048 up to 64 rows run in fused tiles (three to six of them) on AVX-512 builds; past
    64 rows, and on smaller K past 24, through the L2 buffer: every path the same sums."""
    k, out_features, code = 2048, 40, KERNEL_QTYPE[qtype]
    blocks = random_blocks(qtype, out_features, k, seed=2)
    packed, dense = QG.pack_quantized(blocks, code), PG.pack_panels(reference_fp32(qtype, blocks))
    bias = randn(out_features)
    for rows in (25, 33, 64, 65):
        x = randn(rows, k, seed=rows)
        assert np.array_equal(QG.quantized_matmul(x, packed, out_features, bias, code),
                              PG.panel_matmul(x, dense, out_features, bias)), rows


def test_fp32_panels_take_rows_with_any_strides() -> None:
    weight = randn(40, 128)
    wide = randn(40, 256, seed=1)
    wide[:, ::2] = weight
    assert np.array_equal(PG.pack_panels(wide[:, ::2]), PG.pack_panels(weight))  # a weight of columns 2 apart
    packed = PG.pack_panels(weight)
    assert packed.shape == (3, 128, 16) and not packed[2, :, 8:].any()  # the last panel's missing columns are zero
    x = randn(9, 256, seed=2)
    assert np.array_equal(PG.panel_matmul(x[:, ::2], packed, 40, None), PG.panel_matmul(x[:, ::2].copy(), packed, 40, None))
    assert PG.panel_matmul(np.empty((0, 128), np.float32), packed, 40, None).shape == (0, 40)


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_rows_looked_up_from_the_panels_are_gguf_s_values(qtype: str) -> None:
    """The embedding's lookup on blocks: any rows, in any order, repeated, across panels and in the
    last partial one, equal to the dequantized rows bit for bit."""
    blocks = random_blocks(qtype, 37, in_features(qtype), seed=3, wild=True)
    weight, code = reference_fp32(qtype, blocks), KERNEL_QTYPE[qtype]
    packed = QG.pack_quantized(blocks, code)
    ids = np.array([36, 0, 15, 16, 36, 5, 31, 32, 0], dtype=np.int64)
    assert np.array_equal(QG.dequantize_rows(packed, 37, ids, code), weight[ids])
    assert np.array_equal(QG.dequantize_rows(packed, 37, np.arange(37), code), weight)
    assert QG.dequantize_rows(packed, 37, np.empty(0, np.int64), code).shape == (0, weight.shape[1])
    with pytest.raises(RuntimeError, match="out of range"):
        QG.dequantize_rows(packed, 37, np.array([37]), code)


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_column_norms_are_the_dequantized_rows_norms(qtype: str) -> None:
    blocks = random_blocks(qtype, 37, in_features(qtype), seed=4)
    norms = QG.column_norms(QG.pack_quantized(blocks, KERNEL_QTYPE[qtype]), 37, KERNEL_QTYPE[qtype])
    assert norms.dtype == np.float64 and norms.shape == (37,)
    np.testing.assert_allclose(norms, np.linalg.norm(reference_fp32(qtype, blocks).astype(np.float64), axis=1), rtol=1e-12)


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_packed_panels_have_the_layout_s_bytes(qtype: str) -> None:
    """[ceil(N / 16), K / unit, unit bytes]: what the loader's memory check counts (quantized.packed_bytes)."""
    k = in_features(qtype)
    packed = QG.pack_quantized(random_blocks(qtype, 40, k), KERNEL_QTYPE[qtype])
    assert packed.dtype == np.uint8 and packed.shape == (3, k // KERNEL_UNIT_K[qtype], PANEL_UNIT_BYTES[qtype])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "BF16"])
def test_a_run_of_rows_packs_into_its_panels_of_a_larger_array(qtype: str) -> None:
    k, code = in_features(qtype), KERNEL_QTYPE[qtype]
    blocks = random_blocks(qtype, 64, k, seed=5, wild=True)
    whole = QG.pack_quantized(blocks, code)
    out = np.full_like(whole, 0xAB)
    QG.pack_quantized_into(blocks[16:48], code, out[1:3])
    assert np.array_equal(out[1:3], whole[1:3]) and (out[0] == 0xAB).all() and (out[3] == 0xAB).all()
    out.setflags(write=False)
    with pytest.raises(RuntimeError, match="writeable"):
        QG.pack_quantized_into(blocks[16:32], code, out[1:2])


def test_bad_arguments_are_refused() -> None:
    blocks = random_blocks("Q4_1", 32, 64)
    q4_1, q4_k = KERNEL_QTYPE["Q4_1"], KERNEL_QTYPE["Q4_K"]
    packed = QG.pack_quantized(blocks, q4_1)
    with pytest.raises(RuntimeError, match="features"):
        QG.quantized_matmul(randn(2, 96), packed, 32, None, q4_1)
    with pytest.raises(RuntimeError, match="bad packed weight"):
        QG.quantized_matmul(randn(2, 64), packed, 32, None, KERNEL_QTYPE["Q8_0"])
    with pytest.raises(RuntimeError, match="out_features"):
        QG.quantized_matmul(randn(2, 64), packed, 50, None, q4_1)
    with pytest.raises(RuntimeError, match="qtype"):
        QG.pack_quantized(blocks, 23)  # IQ4_XS
    with pytest.raises(RuntimeError, match="qtype"):
        QG.quantized_matmul(randn(2, 64), packed, 32, None, 99)
    with pytest.raises(RuntimeError, match="blocks must be"):
        QG.pack_quantized(np.zeros((4, 145), np.uint8), q4_k)
    with pytest.raises(RuntimeError, match="x must be 2-D fp32"):
        QG.quantized_matmul(randn(2, 64).astype(np.float64), packed, 32, None, q4_1)
    with pytest.raises(RuntimeError, match="bad bias"):
        QG.quantized_matmul(randn(2, 64), packed, 32, randn(31), q4_1)
    with pytest.raises(TypeError):
        QG.quantized_matmul(randn(2, 64).tolist(), packed, 32, None, q4_1)
    assert QG.quantized_matmul(randn(0, 64), packed, 32, None, q4_1).shape == (0, 32)


SCREEN = getattr(QG, "q8_0_argmax", None)
needs_screen = pytest.mark.skipif(SCREEN is None, reason="the screened argmax needs an AVX-512 VNNI/VBMI build")
K, N = 320, 1000  # 10 blocks of 32; 62 full panels and one of 8 columns


def full_argmax(x: np.ndarray, packed: np.ndarray, n: int) -> np.ndarray:
    return QG.quantized_matmul(x, packed, n, None, KERNEL_QTYPE["Q8_0"]).argmax(axis=-1)


@needs_screen
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 17, 33])  # 9, 17, 33: tiles of 8 rows and a remainder
def test_the_screened_argmax_is_the_full_product_s(rows: int) -> None:
    packed = QG.pack_quantized(random_blocks("Q8_0", N, K, seed=rows), KERNEL_QTYPE["Q8_0"])
    x = randn(rows, K, seed=rows)
    x[:, 7] *= 50.0  # an outlier feature, as hidden states have: one block's scale set by it
    got = SCREEN(x, packed, N, 64)
    assert got.dtype == np.int64 and (got >= 0).all()
    assert np.array_equal(got, full_argmax(x, packed, N))


@needs_screen
@pytest.mark.parametrize("n", [993, 1005, 1007])  # a last panel of 1, 13 and 15 columns
def test_the_screened_argmax_in_a_partly_filled_last_panel(n: int) -> None:
    blocks = random_blocks("Q8_0", n, K, seed=n)
    weight, packed = reference_fp32("Q8_0", blocks), QG.pack_quantized(blocks, KERNEL_QTYPE["Q8_0"])
    x = np.concatenate([weight[[n - 1, n - 2, 0]], randn(3, K)])  # the first rows' maxima in the last panel
    expected = full_argmax(x, packed, n)
    assert expected[0] == n - 1 and expected[1] == n - 2
    assert np.array_equal(SCREEN(x, packed, n, 64), expected)


@needs_screen
def test_the_screened_argmax_gives_ties_to_the_first_column_and_gives_up_on_too_many_candidates() -> None:
    blocks = random_blocks("Q8_0", N, K, seed=1)
    blocks[3] = blocks[950] = blocks[900]  # three identical columns, one in the last, partial panel
    weight, packed = reference_fp32("Q8_0", blocks), QG.pack_quantized(blocks, KERNEL_QTYPE["Q8_0"])
    x = weight[900:901].copy()  # column 900's logit is its squared norm: the maximum
    assert int(full_argmax(x, packed, N)[0]) == 3
    assert SCREEN(x, packed, N, 64).tolist() == [3]
    assert SCREEN(np.zeros((2, K), np.float32), packed, N, 16).tolist() == [-1, -1]  # every column a candidate
