"""The integer kernel (kernels/quant_int8.cpp): x quantised per 32 features to int8 as ggml's Q8_0,
multiplied by the GGUF blocks' own codes. Against a float64 reference that dequantises both sides
(x's codes times their scales, the weights by gguf-py) and multiplies: equal up to fp32 rounding, on
every block type, at row counts through one tile, several tiles and several row blocks, with bias
and a partial last panel. The AVX2 and AVX-512 VNNI builds are compared bit for bit by
benchmarks/isa_check.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.model.kernels import quant_gemm, quant_int8
from conveyor.model.quantized import BLOCK_SIZES, KERNEL_QTYPE, KERNEL_TYPES

from .test_quant_gemm import random_blocks, reference_fp32

pytestmark = pytest.mark.skipif(quant_int8() is None or quant_gemm() is None, reason="no integer kernel here")


def quantize_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32 features: dx = max|x| / 127, q = round-half-even(x * 127 / max|x|)."""
    groups = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(groups).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = np.clip(np.rint(groups * inv), -127, 127).astype(np.int8)
    return codes.reshape(x.shape), (amax[..., 0] / np.float32(127)).astype(np.float32)


def reference_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    codes, scales = quant_int8().quantize_activations(x)  # type: ignore[union-attr]
    x_deq = codes.double().reshape(x.shape[0], -1, 32) * scales.double()[..., None]
    y = x_deq.reshape(x.shape) @ weight.double().T
    return y + bias.double() if bias is not None else y


def test_the_activation_codes_are_ggml_s_q8_0() -> None:
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 256)
    x[2, 32:64] = 0.0  # an all-zero group: codes and scale zero
    codes, scales = quant_int8().quantize_activations(x)  # type: ignore[union-attr]
    want_codes, want_scales = quantize_reference(x.numpy())
    assert np.array_equal(codes.numpy(), want_codes)
    assert np.array_equal(scales.numpy(), want_scales)


# Rows through one tile, balanced tiles, and (with K = 4096, 96-row blocks) several row blocks; 1-4
# rows also through AVX2's fused path (codes multiplied as they are unpacked).
@pytest.mark.parametrize("qtype", KERNEL_TYPES)
@pytest.mark.parametrize("rows,k", [(1, 512), (2, 512), (3, 512), (4, 512), (5, 512), (13, 512), (40, 512), (230, 4096)])
def test_product_equals_the_dequantised_product(qtype: str, rows: int, k: int) -> None:
    out_features = 37  # a partial last panel
    q = random_blocks(qtype, out_features, k, seed=rows)
    weight = reference_fp32(q)
    packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(k + rows)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    for b in (None, bias):
        y = quant_int8().int8_matmul(x, packed, out_features, b, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
        want = reference_product(x, weight, b)
        # fp32 sums of k terms: the rounding is bounded by the terms' magnitudes (x's fp32 values instead
        # of its codes miss this bound 50-fold)
        codes, scales = quant_int8().quantize_activations(x)  # type: ignore[union-attr]
        magnitude = (codes.double().abs().reshape(rows, -1, 32) * scales.double()[..., None]).reshape(rows, k)
        bound = (magnitude @ weight.double().abs().T) * 1e-6 * np.sqrt(k / 32) + 1e-7
        assert ((y.double() - want).abs() <= bound).all(), (qtype, rows, (y.double() - want).abs().max().item())


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_a_row_s_result_does_not_depend_on_the_rows_beside_it(qtype: str) -> None:
    # Greedy equality under batching, chunked prefill and speculation rests on it: a few rows (AVX2:
    # the fused path) and many (the buffered tiles) give each row the same bits.
    k, out_features = 512, 37
    q = random_blocks(qtype, out_features, k, seed=3)
    packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(5))
    many = quant_int8().int8_matmul(x, packed, out_features, bias, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    for rows in (1, 2, 3, 4, 5):
        few = quant_int8().int8_matmul(x[:rows], packed, out_features, bias, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
        assert torch.equal(few, many[:rows]), (qtype, rows)


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


def test_bad_arguments_are_refused() -> None:
    q = random_blocks("Q8_0", 16, 64)
    packed = quant_gemm().pack_quantized(q.blocks, KERNEL_QTYPE["Q8_0"])  # type: ignore[union-attr]
    module = quant_int8()
    with pytest.raises(RuntimeError, match="features"):
        module.int8_matmul(torch.randn(2, 96), packed, 16, None, KERNEL_QTYPE["Q8_0"])  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="qtype"):
        module.int8_matmul(torch.randn(2, 64), packed, 16, None, 1)  # type: ignore[union-attr]
    assert BLOCK_SIZES["Q8_0"][0] == 32
