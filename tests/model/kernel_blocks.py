"""Random GGUF blocks and gguf-py's own dequantiser, in numpy: inputs and references for the tests of
the matmul kernels (quant_gemm.cpp, quant_int8.cpp), which take numpy arrays."""
from __future__ import annotations

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType

from conveyor.model.quantized import (BLOCK_SIZES, HALF_TYPES, INT8_TYPES, KERNEL_QTYPE, KERNEL_TYPES,  # noqa: F401 - for the tests
                                     KERNEL_UNIT_K, PANEL_UNIT_BYTES)

# Byte offsets of each block's fp16 fields (d, and the minimum / dmin where there is one).
HALF_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
                "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108]}


def random_halves(rng: np.random.Generator, n: int, wild: bool) -> np.ndarray:
    """fp16 values: `wild`, any finite bit pattern (subnormals, 65504, both signs); else near 0.01."""
    if not wild:
        return rng.uniform(-0.05, 0.05, n).astype(np.float16)
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # inf / NaN exponent -> a finite one
    return bits.view(np.float16)


def random_brain_halves(rng: np.random.Generator, n: int, wild: bool) -> np.ndarray:
    """bf16 bit patterns as uint16: `wild`, any finite one; else values near 0.01."""
    if not wild:
        return (rng.uniform(-0.05, 0.05, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] &= 0xBFFF
    return bits


def random_blocks(qtype: str, rows: int, k: int, seed: int = 0, wild: bool = False) -> np.ndarray:
    """uint8 [rows, k / block weights * block bytes]: every code and scale byte uniformly random, the
    fp16 fields finite (any finite value when `wild`, else scales near 0.01). F16 / BF16: the weights."""
    rng = np.random.default_rng(seed)
    if qtype in HALF_TYPES:
        n = rows * k
        halves = random_halves(rng, n, wild).view(np.uint16) if qtype == "F16" else random_brain_halves(rng, n, wild)
        return np.ascontiguousarray(halves.view(np.uint8).reshape(rows, -1))
    weights, nbytes = BLOCK_SIZES[qtype]
    n_blocks = rows * k // weights
    raw = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    for offset in HALF_OFFSETS[qtype]:
        raw[:, offset:offset + 2] = random_halves(rng, n_blocks, wild).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def reference_fp32(qtype: str, blocks: np.ndarray) -> np.ndarray:
    """float32 [rows, k]: gguf-py's dequantiser (F16 / BF16: the values themselves)."""
    if qtype == "F16":
        return np.ascontiguousarray(blocks).view(np.float16).astype(np.float32)
    if qtype == "BF16":
        return (np.ascontiguousarray(blocks).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    flat = quants.dequantize(np.ascontiguousarray(blocks), GGMLQuantizationType[qtype])
    return np.ascontiguousarray(flat, dtype=np.float32).reshape(blocks.shape[0], -1)


def in_features(qtype: str) -> int:
    """Several units of the kernel's panels."""
    unit = KERNEL_UNIT_K[qtype]
    return 3 * unit if unit == 256 else 4 * unit


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (nearest even, as the kernels round them), as float64."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return rounded.view(np.float32).astype(np.float64)
