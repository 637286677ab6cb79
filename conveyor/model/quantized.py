"""A weight as its checkpoint stores it, in GGUF's quantised blocks or as 16-bit floats (F16, BF16:
a GGUF tensor or an HF safetensors one): what the loader hands to packing
(conveyor.model.linear.pack_blocks), which lays the bytes out for the matmul kernel
(kernels/quant_gemm.cpp). The blocks may be a view of the memory-mapped file."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
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
HALF_DTYPES: dict[torch.dtype, str] = {torch.float16: "F16", torch.bfloat16: "BF16"}
# The bytes of one panel unit (16 columns x KERNEL_UNIT_K) as quant_gemm.cpp lays it out: the file's
# bytes for those weights, except the K-quants' 6-bit scales kept as bytes and Q2_K's / Q3_K's codes
# kept as nibbles (tests/model/test_quant_gemm.py checks this against the kernel).
PANEL_UNIT_BYTES: dict[str, int] = {"Q4_0": 288, "Q4_1": 320, "Q5_0": 352, "Q5_1": 384, "Q8_0": 544, "Q4_K": 2368,
                                    "Q5_K": 2880, "Q6_K": 3360, "Q2_K": 2624, "Q3_K": 2336, "F16": 1024, "BF16": 1024}


def kernel_keeps(qtype: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this GGML type and (torch-order) shape stays in its form, packed: a matrix
    of a type the kernel reads whose rows are whole units of its panels."""
    return qtype in KERNEL_UNIT_K and len(shape) == 2 and shape[1] % KERNEL_UNIT_K[qtype] == 0


def packed_bytes(qtype: str, file_bytes: int) -> int:
    """What a matrix of `file_bytes` in `qtype` holds once packed into the kernel's panels."""
    weights, nbytes = BLOCK_SIZES[qtype]
    unit_file_bytes = 16 * KERNEL_UNIT_K[qtype] // weights * nbytes
    return file_bytes * PANEL_UNIT_BYTES[qtype] // unit_file_bytes


@dataclass(frozen=True)
class QuantizedWeight:
    qtype: str  # a key of BLOCK_SIZES
    blocks: torch.Tensor  # uint8 [out_features, in_features / block weights * block bytes], rows in torch order

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_SIZES:
            raise ValueError(f"unsupported block type {self.qtype!r} (the kernel reads {', '.join(KERNEL_TYPES)})")
        weights, nbytes = BLOCK_SIZES[self.qtype]
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] % nbytes:
            raise ValueError(f"{self.qtype} blocks must be uint8 [rows, k / {weights} * {nbytes}]")

    @staticmethod
    def of_halves(weight: torch.Tensor) -> QuantizedWeight:
        """A 2-D float16 or bfloat16 tensor's own bytes (a view: no copy)."""
        if weight.dtype not in HALF_DTYPES or weight.dim() != 2:
            raise ValueError(f"a 2-D float16 or bfloat16 tensor, not {weight.dtype} of {weight.dim()} dimensions")
        return QuantizedWeight(HALF_DTYPES[weight.dtype], weight.contiguous().view(torch.uint8))

    @property
    def in_features(self) -> int:
        weights, nbytes = BLOCK_SIZES[self.qtype]
        return self.blocks.shape[1] // nbytes * weights

    def kernel_reads(self) -> bool:
        """Whether in_features is whole units of the kernel's panels (always, for quantised blocks)."""
        return kernel_keeps(self.qtype, (self.blocks.shape[0], self.in_features))

    def dequantize(self) -> torch.Tensor:
        """fp32 [out_features, in_features], as gguf's dequantiser gives it (where no kernel packs the blocks)."""
        if self.qtype in HALF_TYPES:
            return self.blocks.contiguous().view(torch.float16 if self.qtype == "F16" else torch.bfloat16).float()
        rows = np.ascontiguousarray(self.blocks.numpy())
        out = quants.dequantize(rows, GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))

    def finite(self) -> bool:
        """Whether every weight is finite, where the scales tell it cheaply (Q8_0: a block's weights
        are its fp16 scale times small integers); True for other types, whose check nobody needs."""
        if self.qtype != "Q8_0":
            return True
        scales = self.blocks.reshape(-1, BLOCK_SIZES["Q8_0"][1])[:, :2].contiguous().view(torch.float16)
        return bool(torch.isfinite(scales).all())
