"""A weight as its checkpoint stores it, in GGUF's quantised blocks or as 16-bit floats (F16, BF16:
a GGUF tensor or an HF safetensors one): what the loader hands to packing
(conveyor.model.linear.pack_blocks), which lays the bytes out for the matmul kernel
(kernels/quant_gemm.cpp). The blocks may be a view of the memory-mapped file.

numpy has no bfloat16: a bf16 value is held as its 16 bits (uint16, the top half of the fp32 with
the same sign and exponent), converted explicitly by `bf16_bits` and `bf16_to_float32`."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF types the kernel reads: (weights, bytes) per block, and GGML's type number, which is
# quant_gemm's qtype argument. INT8_TYPES: the int8 kernel (quant_int8.cpp) multiplies their codes
# too; Q2_K and Q3_K only the fp32 one; HALF_TYPES are plain 16-bit floats (a "block" of one weight).
INT8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
HALF_TYPES = ("F16", "BF16")
KERNEL_TYPES = INT8_TYPES + ("Q2_K", "Q3_K") + HALF_TYPES
BLOCK_SIZES: dict[str, tuple[int, int]] = {t: GGML_QUANT_SIZES[GGMLQuantizationType[t]] for t in KERNEL_TYPES}
KERNEL_QTYPE: dict[str, int] = {t: int(GGMLQuantizationType[t]) for t in KERNEL_TYPES}
# The k steps of one panel unit in the kernel: a block, or 32 16-bit floats. A weight whose
# in_features is not a multiple stays dense.
KERNEL_UNIT_K: dict[str, int] = {t: 32 if t in HALF_TYPES else BLOCK_SIZES[t][0] for t in KERNEL_TYPES}
# The bytes of one panel unit (16 columns x KERNEL_UNIT_K) as quant_gemm.cpp lays it out: the file's
# bytes for those weights, except the K-quants' 6-bit scales kept as bytes and Q2_K's / Q3_K's codes
# kept as nibbles (tests/model/test_quant_gemm.py checks this against the kernel).
PANEL_UNIT_BYTES: dict[str, int] = {"Q4_0": 288, "Q4_1": 320, "Q5_0": 352, "Q5_1": 384, "Q8_0": 544, "Q4_K": 2368,
                                    "Q5_K": 2880, "Q6_K": 3360, "Q2_K": 2624, "Q3_K": 2336, "F16": 1024, "BF16": 1024}


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bfloat16 (to nearest even, as torch's .to(torch.bfloat16) rounds; a
    NaN stays a quiet NaN), as their 16 bits (uint16)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) as fp32 values: exact (a bf16 is the top half of its fp32)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def kernel_keeps(qtype: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this GGML type and (row-major, out x in) shape stays in its form, packed:
    a matrix of a type the kernel reads whose rows are whole units of its panels."""
    return qtype in KERNEL_UNIT_K and len(shape) == 2 and shape[1] % KERNEL_UNIT_K[qtype] == 0


def packed_bytes(qtype: str, file_bytes: int) -> int:
    """What a matrix of `file_bytes` in `qtype` holds once packed into the kernel's panels."""
    weights, nbytes = BLOCK_SIZES[qtype]
    unit_file_bytes = 16 * KERNEL_UNIT_K[qtype] // weights * nbytes
    return file_bytes * PANEL_UNIT_BYTES[qtype] // unit_file_bytes


@dataclass(frozen=True)
class QuantizedWeight:
    qtype: str  # a key of BLOCK_SIZES
    blocks: np.ndarray  # uint8 [out_features, in_features / block weights * block bytes], one row an output feature

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_SIZES:
            raise ValueError(f"unsupported block type {self.qtype!r} (the kernel reads {', '.join(KERNEL_TYPES)})")
        weights, nbytes = BLOCK_SIZES[self.qtype]
        if self.blocks.dtype != np.uint8 or self.blocks.ndim != 2 or self.blocks.shape[1] % nbytes:
            raise ValueError(f"{self.qtype} blocks must be uint8 [rows, k / {weights} * {nbytes}]")

    @staticmethod
    def of_halves(weight: np.ndarray, qtype: str | None = None) -> QuantizedWeight:
        """A 2-D 16-bit float matrix's own bytes (a view where it is contiguous: no copy): float16
        values ("F16"), or bfloat16 bits (uint16, qtype "BF16")."""
        if qtype is None:
            qtype = "F16" if weight.dtype == np.float16 else "BF16" if weight.dtype == np.uint16 else None
        if qtype not in HALF_TYPES or weight.ndim != 2 or weight.dtype.itemsize != 2:
            raise ValueError(f"a 2-D float16 array or bfloat16 bits (uint16), not {weight.dtype} of {weight.ndim} "
                             "dimensions")
        rows = weight.shape[0]
        return QuantizedWeight(qtype, np.ascontiguousarray(weight).view(np.uint8).reshape(rows, -1))

    @property
    def in_features(self) -> int:
        weights, nbytes = BLOCK_SIZES[self.qtype]
        return self.blocks.shape[1] // nbytes * weights

    def kernel_reads(self) -> bool:
        """Whether in_features is whole units of the kernel's panels (always, for quantised blocks)."""
        return kernel_keeps(self.qtype, (self.blocks.shape[0], self.in_features))

    def halves(self) -> np.ndarray:
        """A 16-bit float weight's values as stored: float16, or bfloat16 bits (uint16)."""
        if self.qtype not in HALF_TYPES:
            raise ValueError(f"{self.qtype} blocks are not 16-bit floats")
        return np.ascontiguousarray(self.blocks).view(np.float16 if self.qtype == "F16" else np.uint16)

    def dequantize(self) -> np.ndarray:
        """fp32 [out_features, in_features], as gguf's dequantiser gives it (where no kernel packs the blocks)."""
        if self.qtype == "F16":
            return self.halves().astype(np.float32)
        if self.qtype == "BF16":
            return bf16_to_float32(self.halves())
        out = quants.dequantize(np.ascontiguousarray(self.blocks), GGMLQuantizationType[self.qtype])
        return np.ascontiguousarray(out, dtype=np.float32)

    def finite(self) -> bool:
        """Whether every weight is finite, where the scales tell it cheaply (Q8_0: a block's weights
        are its fp16 scale times small integers); True for other types, whose check nobody needs."""
        if self.qtype != "Q8_0":
            return True
        scales = np.ascontiguousarray(self.blocks.reshape(-1, BLOCK_SIZES["Q8_0"][1])[:, :2]).view(np.float16)
        return bool(np.isfinite(scales).all())
