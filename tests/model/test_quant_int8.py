"""The integer kernel (kernels/quant_int8.cpp): x quantised per 32 features to int8 as ggml's Q8_0
(a group's lone large feature carried exactly beside the codes), multiplied by the GGUF blocks' own
codes. Against a float64 reference that dequantises both sides
(x's codes times their scales, the weights by gguf-py) and multiplies: equal up to fp32 rounding, on
every block type, at row counts through one tile, several tiles and several row blocks, with bias
and a partial last panel. The AVX2 and AVX-512 VNNI builds are compared bit for bit here on a machine
without AVX-512 (its AVX-512 code built on SIMDe's emulation) and, for every kernel, by
benchmarks/isa_check.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.isa_check import EMULATED, build, native_has_avx512
from conveyor.model.kernels import quant_gemm, quant_int8
from conveyor.model.quantized import BLOCK_SIZES, HALF_TYPES, INT8_TYPES, KERNEL_QTYPE

from .test_quant_gemm import random_blocks, reference_fp32

pytestmark = pytest.mark.skipif(quant_int8() is None or quant_gemm() is None, reason="no integer kernel here")


def quantize_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per 32 features: the largest |x| (its first place) is carried exactly, its code 0, where it is
    over the kernel's outlier_ratio times the next largest; then dx = max|x| / 127 over the codes
    left, q = round-half-even(x * 127 / max|x|)."""
    groups = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    magnitude = np.abs(groups)
    top = magnitude.argmax(axis=2)[..., None]
    is_top = np.arange(32) == top
    largest = magnitude.max(axis=2, keepdims=True)
    carried_group = largest > np.float32(quant_int8().outlier_ratio) * np.where(is_top, 0, magnitude).max(axis=2, keepdims=True)  # type: ignore[union-attr]
    carried_place = is_top & carried_group
    amax = np.where(carried_place, 0, magnitude).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = np.where(carried_place, 0, np.clip(np.rint(groups * inv), -127, 127)).astype(np.int8)
    carried = np.where(carried_place, groups, 0).astype(np.float32)
    return codes.reshape(x.shape), (amax[..., 0] / np.float32(127)).astype(np.float32), carried.reshape(x.shape)


def with_outliers(x: torch.Tensor, seed: int) -> torch.Tensor:
    """x with a feature in about one group in five made 5-500x larger: the features real models'
    activations carry exactly (SmolLM2's), in the tiles and in AVX2's fused path."""
    gen = torch.Generator().manual_seed(seed)
    groups = x.reshape(x.shape[0], -1, 32).clone()
    places = torch.randint(0, 32, groups.shape[:2], generator=gen)
    chosen = torch.rand(groups.shape[:2], generator=gen) < 0.2
    factor = torch.exp(torch.empty(groups.shape[:2]).uniform_(np.log(5), np.log(500), generator=gen))
    rows, cols = torch.nonzero(chosen, as_tuple=True)
    groups[rows, cols, places[rows, cols]] *= factor[rows, cols]
    return groups.reshape(x.shape)


def dequantised(x: torch.Tensor) -> torch.Tensor:
    """The x the product multiplies: codes * dx + the features carried exactly, in float64."""
    codes, scales, carried = quant_int8().quantize_activations(x)  # type: ignore[union-attr]
    x_deq = codes.double().reshape(x.shape[0], -1, 32) * scales.double()[..., None]
    return x_deq.reshape(x.shape) + carried.double()


def reference_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = dequantised(x) @ weight.double().T
    return y + bias.double() if bias is not None else y


def test_the_activation_codes_are_ggml_s_q8_0_with_lone_large_features_carried() -> None:
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 256)
    x = with_outliers(x, seed=1)
    x[2, 32:64] = 0.0  # an all-zero group: codes and scale zero
    x[3, 64:96] = 0.0
    x[3, 70] = -3.0  # one feature alone: carried, the rest zero
    x[4, 96:128] = 1.0  # ties: none carried
    codes, scales, carried = quant_int8().quantize_activations(x)  # type: ignore[union-attr]
    want_codes, want_scales, want_carried = quantize_reference(x.numpy())
    assert np.array_equal(codes.numpy(), want_codes)
    assert np.array_equal(scales.numpy(), want_scales)
    assert np.array_equal(carried.numpy(), want_carried)
    assert carried[3, 70] == -3.0 and scales[3, 2] == 0.0 and not carried[4, 96:128].any()
    assert 0.1 < float((carried != 0).sum()) / (7 * 256 / 32) < 0.5


def test_a_lone_large_feature_costs_the_others_no_precision() -> None:
    # One feature 1000x the rest: with it setting the group's scale the others would all round to 0
    # or +-1; carried exactly, the product is as close as the others' own codes make it.
    qtype, k, out_features = "Q8_0", 256, 16
    q = random_blocks(qtype, out_features, k, seed=9)
    weight = reference_fp32(q)
    packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    x[:, 5] *= 1000.0
    y = quant_int8().int8_matmul(x, packed, out_features, None, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    exact = x.double() @ weight.double().T
    # each code within half a step of x: the error bounded by sum |w| * dx / 2 over the group
    bound = (weight.double().abs() @ torch.full((k,), float(x[:, 6:32].abs().max()) / 127 / 2, dtype=torch.float64)) * 1.01
    assert ((y.double() - exact).abs() <= bound).all()


# Rows through one tile, balanced tiles, and (with K = 4096, 96-row blocks) several row blocks; 1-4
# rows through the fused path (codes multiplied as they are unpacked, in registers).
@pytest.mark.parametrize("qtype", INT8_TYPES)
@pytest.mark.parametrize("rows,k", [(1, 512), (2, 512), (3, 512), (4, 512), (5, 512), (13, 512), (40, 512), (230, 4096)])
def test_product_equals_the_dequantised_product(qtype: str, rows: int, k: int) -> None:
    out_features = 37  # a partial last panel
    q = random_blocks(qtype, out_features, k, seed=rows)
    weight = reference_fp32(q)
    packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(k + rows)
    x = with_outliers(torch.randn(rows, k, generator=gen), seed=rows)
    bias = torch.randn(out_features, generator=gen)
    for b in (None, bias):
        y = quant_int8().int8_matmul(x, packed, out_features, b, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
        want = reference_product(x, weight, b)
        # fp32 sums of k terms: the rounding is bounded by the terms' magnitudes (x's fp32 values instead
        # of its codes miss this bound 50-fold)
        magnitude = dequantised(x).abs()
        bound = (magnitude @ weight.double().abs().T) * 1e-6 * np.sqrt(k / 32) + 1e-7
        assert ((y.double() - want).abs() <= bound).all(), (qtype, rows, (y.double() - want).abs().max().item())


@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_a_row_s_result_does_not_depend_on_the_rows_beside_it(qtype: str) -> None:
    # Greedy equality under batching, chunked prefill and speculation rests on it: a few rows (the
    # fused path) and many (the buffered tiles) give each row the same bits.
    k, out_features = 512, 37
    q = random_blocks(qtype, out_features, k, seed=3)
    packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    x = with_outliers(torch.randn(11, k, generator=torch.Generator().manual_seed(4)), seed=6)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(5))
    many = quant_int8().int8_matmul(x, packed, out_features, bias, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    for rows in (1, 2, 3, 4, 5):
        few = quant_int8().int8_matmul(x[:rows], packed, out_features, bias, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
        assert torch.equal(few, many[:rows]), (qtype, rows)


def _tiles() -> bool:
    module = quant_int8()
    return module is not None and bool(module.bf16_tiles())


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def tile_product(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                 qtype: str) -> torch.Tensor:
    return quant_int8().bf16_tile_matmul(x, packed, out_features, bias, KERNEL_QTYPE[qtype])  # type: ignore[union-attr,no-any-return]


needs_tiles = pytest.mark.skipif(not _tiles(), reason="no AMX-BF16 tiles on this CPU")


@needs_tiles
@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_the_tiles_multiply_by_each_weight_rounded_to_bf16(qtype: str) -> None:
    """x = the identity reads the weights back (one exact product each): gguf's value rounded to
    bf16, or its neighbour where the kernel's fused expansion rounds once where gguf's rounds twice."""
    k, out_features = 512, 37
    q = random_blocks(qtype, out_features, k, seed=11)
    packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    read = tile_product(torch.eye(k), packed, out_features, None, qtype).T.double()
    want = bf16(reference_fp32(q))
    ulp = want.abs() * 2.0**-7
    assert ((read - want).abs() <= ulp).all(), qtype
    assert float((read != want).double().mean()) < 0.01, qtype


@needs_tiles
@pytest.mark.parametrize("qtype", INT8_TYPES)
@pytest.mark.parametrize("rows,k,out_features", [(1, 512, 37), (17, 512, 37), (40, 512, 80), (70, 4096, 200)])
def test_the_tile_product_is_x_in_bf16_times_those_weights(qtype: str, rows: int, k: int, out_features: int) -> None:
    """Up to the rounding of fp32 sums over k terms: rows padded past one and two tiles, a partial
    last panel, an odd panel, several runs of panels a thread, with and without bias."""
    q = random_blocks(qtype, out_features, k, seed=rows)
    packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    weight = tile_product(torch.eye(k), packed, out_features, None, qtype).T.double()
    gen = torch.Generator().manual_seed(k + rows)
    x = with_outliers(torch.randn(rows, k, generator=gen), seed=rows)
    bias = torch.randn(out_features, generator=gen)
    for b in (None, bias):
        y = tile_product(x, packed, out_features, b, qtype).double()
        want = bf16(x) @ weight.T + (b.double() if b is not None else 0.0)
        bound = (bf16(x).abs() @ weight.abs().T + (b.double().abs() if b is not None else 0.0)) * (k + 2) * 2.0**-24
        assert ((y - want).abs() <= bound + 1e-30).all(), (qtype, rows, (y - want).abs().max().item())


@needs_tiles
@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_a_tile_row_s_result_does_not_depend_on_the_rows_beside_it(qtype: str) -> None:
    k, out_features = 512, 37
    q = random_blocks(qtype, out_features, k, seed=3)
    packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    x = with_outliers(torch.randn(40, k, generator=torch.Generator().manual_seed(4)), seed=6)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(5))
    many = tile_product(x, packed, out_features, bias, qtype)
    for rows in (1, 2, 5, 16, 17, 33):
        few = tile_product(x[40 - rows:], packed, out_features, bias, qtype)
        assert torch.equal(few, many[40 - rows:]), (qtype, rows)


def test_the_tiles_are_refused_where_they_do_not_run() -> None:
    module = quant_int8()
    q = random_blocks("Q8_0", 16, 64)
    packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE["Q8_0"])  # type: ignore[union-attr]
    if module.bf16_tiles():  # type: ignore[union-attr]
        with pytest.raises(RuntimeError, match="features"):
            module.bf16_tile_matmul(torch.randn(2, 96), packed, 16, None, KERNEL_QTYPE["Q8_0"])  # type: ignore[union-attr]
    else:
        with pytest.raises(RuntimeError, match="AMX"):
            module.bf16_tile_matmul(torch.randn(2, 64), packed, 16, None, KERNEL_QTYPE["Q8_0"])  # type: ignore[union-attr]


def _bf16_dot() -> bool:
    module = quant_int8()
    return module is not None and bool(module.bf16_dot())  # type: ignore[attr-defined]


needs_bf16_dot = pytest.mark.skipif(not _bf16_dot(), reason="no AVX512-BF16 on this CPU")


def half_panels(qtype: str, rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed BF16 or F16 panels, gguf-py's float64 values of those weights rounded to bf16, as the
    product takes them: F16 ones to nearest even, BF16 ones exactly)."""
    q = random_blocks(qtype, rows, k, seed=seed)
    return quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE[qtype]), bf16(reference_fp32(q))  # type: ignore[union-attr]


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
    gen = torch.Generator().manual_seed(k + rows)
    x = with_outliers(torch.randn(rows, k, generator=gen), seed=rows)
    bias = torch.randn(out_features, generator=gen)
    for b in (None, bias):
        y = quant_int8().bf16_dot_matmul(x, packed, out_features, b, code).double()  # type: ignore[union-attr]
        want = bf16(x) @ weight.T + (b.double() if b is not None else 0.0)
        bound = (bf16(x).abs() @ weight.abs().T + (b.double().abs() if b is not None else 0.0)) * (k + 2) * 2.0**-24
        assert ((y - want).abs() <= bound + 1e-30).all(), (rows, (y - want).abs().max().item())
    exact = quant_gemm().quantized_matmul(x, packed, out_features, None, code)  # type: ignore[union-attr]
    assert not torch.equal(exact, quant_int8().bf16_dot_matmul(x, packed, out_features, None, code))  # type: ignore[union-attr]


@needs_bf16_dot
@pytest.mark.parametrize("qtype", HALF_TYPES)
def test_a_bf16_row_s_result_does_not_depend_on_the_rows_beside_it(qtype: str) -> None:
    k, out_features, code = 512, 37, KERNEL_QTYPE[qtype]
    packed, _ = half_panels(qtype, out_features, k, seed=3)
    x = with_outliers(torch.randn(40, k, generator=torch.Generator().manual_seed(4)), seed=6)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(5))
    many = quant_int8().bf16_dot_matmul(x, packed, out_features, bias, code)  # type: ignore[union-attr]
    for rows in (1, 2, 5, 8, 12, 13, 16, 25, 33):
        few = quant_int8().bf16_dot_matmul(x[40 - rows:], packed, out_features, bias, code)  # type: ignore[union-attr]
        assert torch.equal(few, many[40 - rows:]), rows


@needs_bf16_dot
def test_the_bf16_product_takes_strided_rows_no_rows_and_non_finite_rows() -> None:
    k, out_features = 256, 40
    packed, _ = half_panels("BF16", out_features, k, seed=8)

    def product(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        return quant_int8().bf16_dot_matmul(x, packed, out_features, bias, KERNEL_QTYPE["BF16"])  # type: ignore[union-attr]
    wide = torch.randn(7, 2 * k, generator=torch.Generator().manual_seed(9))
    strided = wide[:, k:]  # rows 2k apart
    assert torch.equal(product(strided, packed, out_features, None), product(strided.contiguous(), packed, out_features, None))
    columns = wide[:, :k].T.contiguous().T  # features k apart: copied to rows first
    rows = wide[:, :k].contiguous()
    assert torch.equal(product(columns, packed, out_features, None), product(rows, packed, out_features, None))
    assert product(torch.empty(0, k), packed, out_features, None).shape == (0, out_features)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(10))
    x[0, 5], x[2, 100] = float("inf"), float("nan")
    y = product(x, packed, out_features, None)
    assert not torch.isfinite(y[0]).any() and torch.isnan(y[2]).all() and torch.isfinite(y[1]).all()
    assert torch.equal(y[1:2], product(x[1:2], packed, out_features, None))


def test_the_bf16_product_is_refused_where_it_does_not_run() -> None:
    module = quant_int8()
    packed, _ = half_panels("BF16", 16, 64, seed=1)
    code = KERNEL_QTYPE["BF16"]
    if not module.bf16_dot():  # type: ignore[union-attr]
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            module.bf16_dot_matmul(torch.randn(2, 64), packed, 16, None, code)  # type: ignore[union-attr]
        return
    with pytest.raises(RuntimeError, match="features"):
        module.bf16_dot_matmul(torch.randn(2, 96), packed, 16, None, code)  # type: ignore[union-attr]
    q8 = quant_gemm().pack_quantized(random_blocks("Q8_0", 16, 64).blocks, KERNEL_QTYPE["Q8_0"])  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="not 16-bit panels"):
        module.bf16_dot_matmul(torch.randn(2, 64), q8, 16, None, code)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="qtype"):
        module.bf16_dot_matmul(torch.randn(2, 64), q8, 16, None, KERNEL_QTYPE["Q8_0"])  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="out_features"):
        module.bf16_dot_matmul(torch.randn(2, 64), packed, 40, None, code)  # type: ignore[union-attr]


def test_a_row_with_inf_or_nan_gives_nan_and_leaves_the_others() -> None:
    qtype, k = "Q4_K", 512
    q = random_blocks(qtype, 16, k)
    packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    x[0, 5], x[2, 300] = float("inf"), float("nan")
    y = quant_int8().int8_matmul(x, packed, 16, None, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    assert torch.isnan(y[0]).all() and torch.isnan(y[2]).all() and torch.isfinite(y[1]).all()
    alone = quant_int8().int8_matmul(x[1:2], packed, 16, None, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    assert torch.equal(y[1:2], alone)


def test_a_product_writes_into_rows_of_a_larger_result() -> None:
    # linear._by_origin writes each run of a step's rows (prompt tokens, generated ones) straight
    # into its rows of the step's result: the same bits as a result of its own, the rows around untouched.
    qtype, k, n = "Q5_0", 256, 40
    q = random_blocks(qtype, n, k, seed=7)
    packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    x = with_outliers(torch.randn(20, k, generator=torch.Generator().manual_seed(8)), seed=9)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(10))
    module = quant_int8()
    products = [module.int8_matmul]  # type: ignore[union-attr]
    if module.bf16_tiles():  # type: ignore[union-attr]
        products.append(module.bf16_tile_matmul)  # type: ignore[union-attr]
    for product in products:
        y = torch.full((26, n), 7.0)
        returned = product(x[3:20], packed, n, bias, KERNEL_QTYPE[qtype], out=y[5:22])
        assert returned.data_ptr() == y[5:22].data_ptr()
        assert torch.equal(y[5:22], product(x[3:20], packed, n, bias, KERNEL_QTYPE[qtype]))
        assert (y[:5] == 7.0).all() and (y[22:] == 7.0).all()
        for bad in (torch.empty(17, n + 1), torch.empty(17, n, dtype=torch.float64), torch.empty(n, 17).T):
            with pytest.raises(RuntimeError, match="out must be a contiguous fp32"):
                product(x[3:20], packed, n, bias, KERNEL_QTYPE[qtype], out=bad)


def test_bad_arguments_are_refused() -> None:
    q = random_blocks("Q8_0", 16, 64)
    packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE["Q8_0"])  # type: ignore[union-attr]
    module = quant_int8()
    with pytest.raises(RuntimeError, match="features"):
        module.int8_matmul(torch.randn(2, 96), packed, 16, None, KERNEL_QTYPE["Q8_0"])  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="qtype"):
        module.int8_matmul(torch.randn(2, 64), packed, 16, None, 1)  # type: ignore[union-attr]
    assert BLOCK_SIZES["Q8_0"][0] == 32


@pytest.mark.skipif(native_has_avx512(), reason="this CPU runs the AVX-512 build itself, in the tests above")
def test_the_avx512_build_gives_the_avx2_build_s_bits() -> None:
    # CI's machine may lack AVX-512: its build there is SIMDe's emulation of the instructions
    # (benchmarks/isa_check.py, which checks every kernel so), slow but with their results.
    emulated = build("quant_int8", EMULATED)
    assert emulated.isa() == "avx512-vnni"  # type: ignore[attr-defined]
    for qtype in INT8_TYPES:
        k = 768 if BLOCK_SIZES[qtype][0] == 256 else 256
        q = random_blocks(qtype, 40, k, seed=11)
        packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
        bias = torch.randn(40, generator=torch.Generator().manual_seed(12))
        for rows in (1, 4, 17, 33):
            x = with_outliers(torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)), seed=rows)
            for b in (None, bias):
                native = quant_int8().int8_matmul(x, packed, 40, b, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
                assert torch.equal(native, emulated.int8_matmul(x, packed, 40, b, KERNEL_QTYPE[qtype])), (qtype, rows)  # type: ignore[attr-defined]
