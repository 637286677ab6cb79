"""Linear layers whose fp32 weights are pre-packed once for oneDNN.

On the 2-core AMD EPYC this was measured on (AVX2, no AMX), `F.linear` on a plain [out, in] fp32
weight reaches ~10-100 GFLOP/s at the 1-64 rows a decode step has; the same product through oneDNN
on a weight reordered once into its blocked layout reaches ~15-120, and the 49k-row vocabulary
projection gains most. In whole decode steps the gap is widest at 2-8 rows, where MKL's plain
path is slowest (batch 2: 115 vs 56 ms; `python benchmarks/packed_linear.py`). Prefill-sized
products keep MKL's plain path, which is as fast there. CONVEYOR_PACKED_LINEAR=0 turns packing
off (A/B runs, debugging); results then differ only in fp32 rounding.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# From prefill-sized batches up, MKL on the plain weight is as fast or a few % faster (measured
# 0.92-0.99x at 512-2048 rows: benchmarks/packed_linear.py --matmuls --matmul-rows 512 2048).
PLAIN_FROM_ROWS = 512
# oneDNN picks the blocked layout for an expected number of rows; decode batches sit around here.
_ROWS_HINT = 32


def packing_enabled() -> bool:
    return os.environ.get("CONVEYOR_PACKED_LINEAR", "1") != "0"


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where packing does not apply (non-fp32
    weights, a torch built without oneDNN, or packing turned off)."""
    if weight.dtype != torch.float32 or not packing_enabled() or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)
    except (AttributeError, RuntimeError):  # a torch without the op: the plain path still works
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    if packed is not None and x.dtype == packed.dtype and x.shape[0] < PLAIN_FROM_ROWS and packing_enabled():
        return packed_product(x, packed, bias)
    return F.linear(x, weight, bias)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear that, once `pack()` is called after loading, runs on its packed weight.
    The plain weight stays (tied embeddings, export, the CONVEYOR_PACKED_LINEAR=0 path)."""

    packed: torch.Tensor | None = None

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.bias)
