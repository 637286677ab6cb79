"""A weight as its checkpoint stores it in quantised blocks: what the loader hands to packing
(conveyor.model.linear.pack_blocks), which lays the blocks out for the matmul kernel
(kernels/quant_gemm.cpp). The blocks may be a view of the memory-mapped file."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF block types the kernel reads: (weights, bytes) per block, and GGML's type number, which is
# quant_gemm's qtype argument.
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
BLOCK_SIZES: dict[str, tuple[int, int]] = {t: GGML_QUANT_SIZES[GGMLQuantizationType[t]] for t in KERNEL_TYPES}
KERNEL_QTYPE: dict[str, int] = {t: int(GGMLQuantizationType[t]) for t in KERNEL_TYPES}


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

    @property
    def in_features(self) -> int:
        weights, nbytes = BLOCK_SIZES[self.qtype]
        return self.blocks.shape[1] // nbytes * weights

    def dequantize(self) -> torch.Tensor:
        """fp32 [out_features, in_features], as gguf's dequantiser gives it (where no kernel packs the blocks)."""
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
