"""A weight as its checkpoint stores it in quantised blocks, kept beside the dequantised fp32 copy
so the matmul can stream the blocks (see kernels/quant_gemm.cpp) instead of 4 bytes a weight."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# GGUF block types the kernel reads, with their bytes per block of 32 weights.
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
KERNEL_QTYPE = {"Q4_1": 0, "Q8_0": 1}  # quant_gemm's qtype argument


@dataclass(frozen=True)
class QuantizedWeight:
    qtype: str  # a key of BLOCK_BYTES
    blocks: torch.Tensor  # uint8 [out_features, in_features / 32 * BLOCK_BYTES[qtype]], rows in torch order

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported block type {self.qtype!r}")
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] % BLOCK_BYTES[self.qtype]:
            raise ValueError(f"{self.qtype} blocks must be uint8 [rows, k / 32 * {BLOCK_BYTES[self.qtype]}]")

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1] // BLOCK_BYTES[self.qtype] * 32

    @staticmethod
    def cat(parts: list[QuantizedWeight | None]) -> QuantizedWeight | None:
        """The row-wise concatenation (fused q/k/v, gate/up), or None unless every part has blocks
        of one type."""
        if not parts or any(p is None for p in parts) or len({p.qtype for p in parts}) != 1:  # type: ignore[union-attr]
            return None
        return QuantizedWeight(parts[0].qtype, torch.cat([p.blocks for p in parts]))  # type: ignore[union-attr]
