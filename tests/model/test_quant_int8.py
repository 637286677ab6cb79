"""The integer kernel (kernels/quant_int8.cpp): x quantised per 32 features to int8 as ggml's Q8_0
(a group's lone large feature carried exactly beside the codes), multiplied by the GGUF blocks' own
codes. Against a float64 reference that dequantises both sides
(x's codes times their scales, the weights by gguf-py) and multiplies: equal up to fp32 rounding, on
every block type, at row counts through one tile, several tiles and several row blocks, with bias
and a partial last panel. The AVX2 and AVX-512 VNNI builds are compared bit for bit here on a machine
without AVX-512 (its AVX-512 code built on SIMDe's emulation) and, for every kernel, by
benchmarks/isa_check.py."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from benchmarks.isa_check import EMULATED, build, native_has_avx512
from conveyor.model.kernels import quant_gemm, quant_int8

from .kernel_blocks import BLOCK_SIZES, HALF_TYPES, INT8_TYPES, KERNEL_QTYPE, bf16, random_blocks, reference_fp32

pytestmark = pytest.mark.skipif(quant_int8() is None or quant_gemm() is None, reason="no integer kernel here")
I8: Any = quant_int8()
QG: Any = quant_gemm()


def randn(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def pack(qtype: str, blocks: np.ndarray) -> np.ndarray:
    return QG.pack_quantized(blocks, KERNEL_QTYPE[qtype])  # type: ignore[no-any-return]


def quantize_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per 32 features: the largest |x| (its first place) is carried exactly, its code 0, where it is
    over the kernel's outlier_ratio times the next largest; then dx = max|x| / 127 over the codes
    left, q = round-half-even(x * 127 / max|x|)."""
    groups = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    magnitude = np.abs(groups)
    top = magnitude.argmax(axis=2)[..., None]
    is_top = np.arange(32) == top
    largest = magnitude.max(axis=2, keepdims=True)
    carried_group = largest > np.float32(I8.outlier_ratio) * np.where(is_top, 0, magnitude).max(axis=2, keepdims=True)
    carried_place = is_top & carried_group
    amax = np.where(carried_place, 0, magnitude).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = np.where(carried_place, 0, np.clip(np.rint(groups * inv), -127, 127)).astype(np.int8)
    carried = np.where(carried_place, groups, 0).astype(np.float32)
    return codes.reshape(x.shape), (amax[..., 0] / np.float32(127)).astype(np.float32), carried.reshape(x.shape)


def with_outliers(x: np.ndarray, seed: int) -> np.ndarray:
    """x with a feature in about one group in five made 5-500x larger: the features real models'
    activations carry exactly (SmolLM2's), in the tiles and in AVX2's fused path."""
    rng = np.random.default_rng(seed)
    groups = x.reshape(x.shape[0], -1, 32).copy()
    places = rng.integers(0, 32, groups.shape[:2])
    chosen = rng.random(groups.shape[:2]) < 0.2
    factor = np.exp(rng.uniform(np.log(5), np.log(500), groups.shape[:2])).astype(np.float32)
    rows, cols = np.nonzero(chosen)
    groups[rows, cols, places[rows, cols]] *= factor[rows, cols]
    return groups.reshape(x.shape)


def dequantised(x: np.ndarray) -> np.ndarray:
    """The x the product multiplies: codes * dx + the features carried exactly, in float64."""
    codes, scales, carried = I8.quantize_activations(x)
    x_deq = codes.astype(np.float64).reshape(x.shape[0], -1, 32) * scales.astype(np.float64)[..., None]
    return x_deq.reshape(x.shape) + carried.astype(np.float64)


def reference_product(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    y = dequantised(x) @ weight.astype(np.float64).T
    return y + bias.astype(np.float64) if bias is not None else y


def test_the_activation_codes_are_ggml_s_q8_0_with_lone_large_features_carried() -> None:
    x = randn(7, 256) * np.logspace(-3, 3, 256, dtype=np.float32)
    x = with_outliers(x, seed=1)
    x[2, 32:64] = 0.0  # an all-zero group: codes and scale zero
    x[3, 64:96] = 0.0
    x[3, 70] = -3.0  # one feature alone: carried, the rest zero
    x[4, 96:128] = 1.0  # ties: none carried
    codes, scales, carried = I8.quantize_activations(x)
    assert codes.dtype == np.int8 and scales.dtype == np.float32 and carried.dtype == np.float32
    want_codes, want_scales, want_carried = quantize_reference(x)
    assert np.array_equal(codes, want_codes)
    assert np.array_equal(scales, want_scales)
    assert np.array_equal(carried, want_carried)
    assert carried[3, 70] == -3.0 and scales[3, 2] == 0.0 and not carried[4, 96:128].any()
    assert 0.1 < float((carried != 0).sum()) / (7 * 256 / 32) < 0.5


def test_a_lone_large_feature_costs_the_others_no_precision() -> None:
    # One feature 1000x the rest: with it setting the group's scale the others would all round to 0
    # or +-1; carried exactly, the product is as close as the others' own codes make it.
    qtype, k, out_features = "Q8_0", 256, 16
    blocks = random_blocks(qtype, out_features, k, seed=9)
    weight = reference_fp32(qtype, blocks).astype(np.float64)
    x = randn(3, k, seed=2)
    x[:, 5] *= 1000.0
    y = I8.int8_matmul(x, pack(qtype, blocks), out_features, None, KERNEL_QTYPE[qtype])
    exact = x.astype(np.float64) @ weight.T
    # each code within half a step of x: the error bounded by sum |w| * dx / 2 over the group
    bound = (np.abs(weight) @ np.full(k, float(np.abs(x[:, 6:32]).max()) / 127 / 2)) * 1.01
    assert (np.abs(y - exact) <= bound).all()


# Rows through one tile, balanced tiles, and (with K = 4096, 96-row blocks) several row blocks; 1-4
# rows through the fused path (codes multiplied as they are unpacked, in registers).
@pytest.mark.parametrize("qtype", INT8_TYPES)
@pytest.mark.parametrize("rows,k", [(1, 512), (2, 512), (3, 512), (4, 512), (5, 512), (13, 512), (40, 512), (230, 4096)])
def test_product_equals_the_dequantised_product(qtype: str, rows: int, k: int) -> None:
    out_features = 37  # a partial last panel
    blocks = random_blocks(qtype, out_features, k, seed=rows)
    weight = reference_fp32(qtype, blocks)
    packed = pack(qtype, blocks)
    x = with_outliers(randn(rows, k, seed=k + rows), seed=rows)
    bias = randn(out_features, seed=k + rows + 1)
    for b in (None, bias):
        y = I8.int8_matmul(x, packed, out_features, b, KERNEL_QTYPE[qtype])
        assert y.dtype == np.float32 and y.shape == (rows, out_features)
        want = reference_product(x, weight, b)
        # fp32 sums of k terms: the rounding is bounded by the terms' magnitudes (x's fp32 values instead
        # of its codes miss this bound 50-fold)
        magnitude = np.abs(dequantised(x))
        bound = (magnitude @ np.abs(weight.astype(np.float64)).T) * 1e-6 * np.sqrt(k / 32) + 1e-7
        assert (np.abs(y - want) <= bound).all(), (qtype, rows, np.abs(y - want).max())


@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_a_row_s_result_does_not_depend_on_the_rows_beside_it(qtype: str) -> None:
    # Greedy equality under batching, chunked prefill and speculation rests on it: a few rows (the
    # fused path) and many (the buffered tiles) give each row the same bits.
    k, out_features = 512, 37
    packed = pack(qtype, random_blocks(qtype, out_features, k, seed=3))
    x = with_outliers(randn(11, k, seed=4), seed=6)
    bias = randn(out_features, seed=5)
    many = I8.int8_matmul(x, packed, out_features, bias, KERNEL_QTYPE[qtype])
    for rows in (1, 2, 3, 4, 5):
        few = I8.int8_matmul(x[:rows], packed, out_features, bias, KERNEL_QTYPE[qtype])
        assert np.array_equal(few, many[:rows]), (qtype, rows)


def _tiles() -> bool:
    return I8 is not None and bool(I8.bf16_tiles())


def tile_product(x: np.ndarray, packed: np.ndarray, out_features: int, bias: np.ndarray | None, qtype: str) -> np.ndarray:
    return I8.bf16_tile_matmul(x, packed, out_features, bias, KERNEL_QTYPE[qtype])  # type: ignore[no-any-return]


needs_tiles = pytest.mark.skipif(not _tiles(), reason="no AMX-BF16 tiles on this CPU")


@needs_tiles
@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_the_tiles_multiply_by_each_weight_rounded_to_bf16(qtype: str) -> None:
    """x = the identity reads the weights back (one exact product each): gguf's value rounded to
    bf16, or its neighbour where the kernel's fused expansion rounds once where gguf's rounds twice."""
    k, out_features = 512, 37
    blocks = random_blocks(qtype, out_features, k, seed=11)
    read = tile_product(np.eye(k, dtype=np.float32), pack(qtype, blocks), out_features, None, qtype).T.astype(np.float64)
    want = bf16(reference_fp32(qtype, blocks))
    assert (np.abs(read - want) <= np.abs(want) * 2.0**-7).all(), qtype
    assert float((read != want).mean()) < 0.01, qtype


@needs_tiles
@pytest.mark.parametrize("qtype", INT8_TYPES)
@pytest.mark.parametrize("rows,k,out_features", [(1, 512, 37), (17, 512, 37), (40, 512, 80), (70, 4096, 200)])
def test_the_tile_product_is_x_in_bf16_times_those_weights(qtype: str, rows: int, k: int, out_features: int) -> None:
    """Up to the rounding of fp32 sums over k terms: rows padded past one and two tiles, a partial
    last panel, an odd panel, several runs of panels a thread, with and without bias."""
    packed = pack(qtype, random_blocks(qtype, out_features, k, seed=rows))
    weight = tile_product(np.eye(k, dtype=np.float32), packed, out_features, None, qtype).T.astype(np.float64)
    x = with_outliers(randn(rows, k, seed=k + rows), seed=rows)
    bias = randn(out_features, seed=k + rows + 1)
    for b in (None, bias):
        y = tile_product(x, packed, out_features, b, qtype).astype(np.float64)
        extra = b.astype(np.float64) if b is not None else 0.0
        want = bf16(x) @ weight.T + extra
        bound = (np.abs(bf16(x)) @ np.abs(weight).T + np.abs(extra)) * (k + 2) * 2.0**-24
        assert (np.abs(y - want) <= bound + 1e-30).all(), (qtype, rows, np.abs(y - want).max())


@needs_tiles
@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_a_tile_row_s_result_does_not_depend_on_the_rows_beside_it(qtype: str) -> None:
    k, out_features = 512, 37
    packed = pack(qtype, random_blocks(qtype, out_features, k, seed=3))
    x = with_outliers(randn(40, k, seed=4), seed=6)
    bias = randn(out_features, seed=5)
    many = tile_product(x, packed, out_features, bias, qtype)
    for rows in (1, 2, 5, 16, 17, 33):
        few = tile_product(x[40 - rows:], packed, out_features, bias, qtype)
        assert np.array_equal(few, many[40 - rows:]), (qtype, rows)


def test_the_tiles_are_refused_where_they_do_not_run() -> None:
    packed = pack("Q8_0", random_blocks("Q8_0", 16, 64))
    if I8.bf16_tiles():
        with pytest.raises(RuntimeError, match="features"):
            I8.bf16_tile_matmul(randn(2, 96), packed, 16, None, KERNEL_QTYPE["Q8_0"])
    else:
        with pytest.raises(RuntimeError, match="AMX"):
            I8.bf16_tile_matmul(randn(2, 64), packed, 16, None, KERNEL_QTYPE["Q8_0"])


def _bf16_dot() -> bool:
    return I8 is not None and bool(I8.bf16_dot())


needs_bf16_dot = pytest.mark.skipif(not _bf16_dot(), reason="no AVX512-BF16 on this CPU")


def half_panels(qtype: str, rows: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(packed BF16 or F16 panels, gguf-py's float64 values of those weights rounded to bf16, as the
    product takes them: F16 ones to nearest even, BF16 ones exactly)."""
    blocks = random_blocks(qtype, rows, k, seed=seed)
    return pack(qtype, blocks), bf16(reference_fp32(qtype, blocks))


@needs_bf16_dot
@pytest.mark.parametrize("qtype", HALF_TYPES)
@pytest.mark.parametrize("rows,k,out_features", [(1, 32, 37), (5, 512, 37), (12, 512, 80), (13, 512, 80),
                                                 (16, 96, 17), (40, 512, 20), (40, 4096, 200)])
def test_16_bit_weights_times_x_rounded_to_bf16(qtype: str, rows: int, k: int, out_features: int) -> None:
    """BF16 / F16 panels against float64: bf16(x) @ bf16(W)^T + b, up to the rounding of fp32 sums
    over k terms; one tile, tiles sharing rows evenly, a partial last panel, an odd panel, with and
    without bias."""
    packed, weight = half_panels(qtype, out_features, k, seed=rows)
    code = KERNEL_QTYPE[qtype]
    x = with_outliers(randn(rows, k, seed=k + rows), seed=rows)
    bias = randn(out_features, seed=k + rows + 1)
    for b in (None, bias):
        y = I8.bf16_dot_matmul(x, packed, out_features, b, code).astype(np.float64)
        extra = b.astype(np.float64) if b is not None else 0.0
        want = bf16(x) @ weight.T + extra
        bound = (np.abs(bf16(x)) @ np.abs(weight).T + np.abs(extra)) * (k + 2) * 2.0**-24
        assert (np.abs(y - want) <= bound + 1e-30).all(), (rows, np.abs(y - want).max())
    exact = QG.quantized_matmul(x, packed, out_features, None, code)
    assert not np.array_equal(exact, I8.bf16_dot_matmul(x, packed, out_features, None, code))


@needs_bf16_dot
@pytest.mark.parametrize("qtype", HALF_TYPES)
def test_a_bf16_row_s_result_does_not_depend_on_the_rows_beside_it(qtype: str) -> None:
    k, out_features, code = 512, 37, KERNEL_QTYPE[qtype]
    packed, _ = half_panels(qtype, out_features, k, seed=3)
    x = with_outliers(randn(40, k, seed=4), seed=6)
    bias = randn(out_features, seed=5)
    many = I8.bf16_dot_matmul(x, packed, out_features, bias, code)
    for rows in (1, 2, 5, 8, 12, 13, 16, 25, 33):
        few = I8.bf16_dot_matmul(x[40 - rows:], packed, out_features, bias, code)
        assert np.array_equal(few, many[40 - rows:]), rows


@needs_bf16_dot
def test_the_bf16_product_takes_strided_rows_no_rows_and_non_finite_rows() -> None:
    k, out_features = 256, 40
    packed, _ = half_panels("BF16", out_features, k, seed=8)

    def product(x: np.ndarray) -> np.ndarray:
        return I8.bf16_dot_matmul(x, packed, out_features, None, KERNEL_QTYPE["BF16"])  # type: ignore[no-any-return]

    wide = randn(7, 2 * k, seed=9)
    strided = wide[:, k:]  # rows 2k apart
    assert np.array_equal(product(strided), product(strided.copy()))
    columns = np.asfortranarray(wide[:, :k])  # features 7 apart: copied to rows first
    assert np.array_equal(product(columns), product(wide[:, :k].copy()))
    assert product(np.empty((0, k), np.float32)).shape == (0, out_features)
    x = randn(3, k, seed=10)
    x[0, 5], x[2, 100] = float("inf"), float("nan")
    y = product(x)
    assert not np.isfinite(y[0]).any() and np.isnan(y[2]).all() and np.isfinite(y[1]).all()
    assert np.array_equal(y[1:2], product(x[1:2]))


def test_the_bf16_product_is_refused_where_it_does_not_run() -> None:
    packed, _ = half_panels("BF16", 16, 64, seed=1)
    code = KERNEL_QTYPE["BF16"]
    if not I8.bf16_dot():
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            I8.bf16_dot_matmul(randn(2, 64), packed, 16, None, code)
        return
    with pytest.raises(RuntimeError, match="features"):
        I8.bf16_dot_matmul(randn(2, 96), packed, 16, None, code)
    q8 = pack("Q8_0", random_blocks("Q8_0", 16, 64))
    with pytest.raises(RuntimeError, match="not 16-bit panels"):
        I8.bf16_dot_matmul(randn(2, 64), q8, 16, None, code)
    with pytest.raises(RuntimeError, match="qtype"):
        I8.bf16_dot_matmul(randn(2, 64), q8, 16, None, KERNEL_QTYPE["Q8_0"])
    with pytest.raises(RuntimeError, match="out_features"):
        I8.bf16_dot_matmul(randn(2, 64), packed, 40, None, code)


def test_a_row_with_inf_or_nan_gives_nan_and_leaves_the_others() -> None:
    qtype, k = "Q4_K", 512
    packed = pack(qtype, random_blocks(qtype, 16, k))
    x = randn(3, k, seed=1)
    x[0, 5], x[2, 300] = float("inf"), float("nan")
    y = I8.int8_matmul(x, packed, 16, None, KERNEL_QTYPE[qtype])
    assert np.isnan(y[0]).all() and np.isnan(y[2]).all() and np.isfinite(y[1]).all()
    assert np.array_equal(y[1:2], I8.int8_matmul(x[1:2], packed, 16, None, KERNEL_QTYPE[qtype]))


def test_a_product_writes_into_rows_of_a_larger_result() -> None:
    # linear._by_origin writes each run of a step's rows (prompt tokens, generated ones) straight
    # into its rows of the step's result: the same bits as a result of its own, the rows around untouched.
    qtype, k, n = "Q5_0", 256, 40
    packed = pack(qtype, random_blocks(qtype, n, k, seed=7))
    x = with_outliers(randn(20, k, seed=8), seed=9)
    bias = randn(n, seed=10)
    products: list[Callable[..., np.ndarray]] = [I8.int8_matmul]
    if I8.bf16_tiles():
        products.append(I8.bf16_tile_matmul)
    for product in products:
        y = np.full((26, n), 7.0, np.float32)
        rows = y[5:22]
        returned = product(x[3:20], packed, n, bias, KERNEL_QTYPE[qtype], out=rows)
        assert returned is rows, "the array passed as out comes back"
        assert np.array_equal(y[5:22], product(x[3:20], packed, n, bias, KERNEL_QTYPE[qtype]))
        assert (y[:5] == 7.0).all() and (y[22:] == 7.0).all()
        for bad in (np.empty((17, n + 1), np.float32), np.empty((17, n), np.float64), np.empty((n, 17), np.float32).T):
            with pytest.raises(RuntimeError, match="out must be a contiguous fp32"):
                product(x[3:20], packed, n, bias, KERNEL_QTYPE[qtype], out=bad)
        y.setflags(write=False)
        with pytest.raises(RuntimeError, match="writeable"):
            product(x[3:20], packed, n, bias, KERNEL_QTYPE[qtype], out=y[5:22])


def test_bad_arguments_are_refused() -> None:
    packed = pack("Q8_0", random_blocks("Q8_0", 16, 64))
    with pytest.raises(RuntimeError, match="features"):
        I8.int8_matmul(randn(2, 96), packed, 16, None, KERNEL_QTYPE["Q8_0"])
    with pytest.raises(RuntimeError, match="qtype"):
        I8.int8_matmul(randn(2, 64), packed, 16, None, 1)
    assert BLOCK_SIZES["Q8_0"][0] == 32


@pytest.mark.skipif(native_has_avx512(), reason="this CPU runs the AVX-512 build itself, in the tests above")
def test_the_avx512_build_gives_the_avx2_build_s_bits() -> None:
    # CI's machine may lack AVX-512: its build there is SIMDe's emulation of the instructions
    # (benchmarks/isa_check.py, which checks every kernel so), slow but with their results.
    emulated: Any = build("quant_int8", EMULATED)
    assert emulated.isa() == "avx512-vnni"
    for qtype in INT8_TYPES:
        k = 768 if BLOCK_SIZES[qtype][0] == 256 else 256
        packed = pack(qtype, random_blocks(qtype, 40, k, seed=11))
        bias = randn(40, seed=12)
        for rows in (1, 4, 17, 33):
            x = with_outliers(randn(rows, k, seed=rows), seed=rows)
            for b in (None, bias):
                native = I8.int8_matmul(x, packed, 40, b, KERNEL_QTYPE[qtype])
                assert np.array_equal(native, emulated.int8_matmul(x, packed, 40, b, KERNEL_QTYPE[qtype])), (qtype, rows)
