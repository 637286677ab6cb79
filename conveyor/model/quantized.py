"""A weight as its checkpoint stores it in quantised blocks, kept beside the dequantised fp32 copy
so the matmul can stream the blocks (see kernels/quant_gemm.cpp) instead of 4 bytes a weight."""
from __future__ import annotations

from dataclasses import dataclass

import torch
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

    @staticmethod
    def cat(parts: list[QuantizedWeight | None]) -> QuantizedWeight | QuantizedParts | None:
        """The row-wise concatenation (fused q/k/v, gate/up): one weight where every part has blocks
        of one type, the parts side by side where their types differ (a Q4_K_M file's Q5_0 q/k
        beside a Q8_0 v), None unless every part has blocks."""
        if not parts or any(p is None for p in parts):
            return None
        present = [p for p in parts if p is not None]
        merged: list[QuantizedWeight] = []
        for p in present:  # runs of one type concatenate into one part
            if merged and merged[-1].qtype == p.qtype:
                merged[-1] = QuantizedWeight(p.qtype, torch.cat([merged[-1].blocks, p.blocks]))
            else:
                merged.append(p)
        return merged[0] if len(merged) == 1 else QuantizedParts(tuple(merged))


@dataclass(frozen=True)
class QuantizedParts:
    """A fused weight whose row ranges come in different block types, each a QuantizedWeight."""
    parts: tuple[QuantizedWeight, ...]

    def __post_init__(self) -> None:
        if len({p.in_features for p in self.parts}) != 1:
            raise ValueError("the parts of a fused weight must have the same in_features")

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(p.blocks.shape[0] for p in self.parts)
