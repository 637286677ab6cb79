"""Linear layers whose fp32 weights are laid out once, at load, for the few rows of a decode step.

A decode step multiplies 1-64 rows by every weight matrix, streaming the weights from memory.
At those rows `F.linear` (MKL) on the plain [out, in] weight and oneDNN on its own blocked layout
fall well short of the machine's bandwidth and FMA peak; conveyor's panel kernel
(kernels/panel_gemm.cpp) reads each weight once as one stream and gets close to both (figures in
docs/PERF.md). On SmolLM2-135M's products it matches or beats MKL up to 2048-row prefill chunks;
from 4096 rows MKL's plain path runs. Where the kernel can't be built, weights are packed for oneDNN instead.
CONVEYOR_PACKED_LINEAR=0 turns packing off (A/B runs, debugging); results then differ only in fp32
rounding.

A weight the checkpoint stores in GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is
packed from those blocks instead (kernels/quant_gemm.cpp): the same panels at 0.56-1.06 bytes a
weight, expanded to fp32 in registers, with results bit-identical to the fp32 panels. The fp32 weight stays for the rest.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.kernels import panel_gemm, quant_gemm
from conveyor.model.quantized import KERNEL_QTYPE, QuantizedParts, QuantizedWeight

# From these rows up MKL on the plain weight is as fast or faster (measured: docs/PERF.md, "the
# panel kernel").
PLAIN_FROM_ROWS = {"panels": 4096, "onednn": 512, "parts": 4096, **{qtype: 4096 for qtype in KERNEL_QTYPE}}
# oneDNN picks its blocked layout for an expected number of rows; decode batches sit around here.
_ONEDNN_ROWS_HINT = 32


@dataclass(frozen=True)
class PackedWeight:
    data: torch.Tensor
    out_features: int
    # "panels": conveyor's kernel; "onednn": oneDNN's blocked layout; a KERNEL_QTYPE key: GGUF blocks
    # in panels; "parts": row ranges in different block types, each in `parts` (data is empty)
    layout: str
    parts: tuple[PackedWeight, ...] = ()

    @property
    def nbytes(self) -> int:
        """The bytes a product streams."""
        return sum(p.nbytes for p in self.parts) if self.parts else self.data.numel() * self.data.element_size()


def packing_enabled() -> bool:
    return os.environ.get("CONVEYOR_PACKED_LINEAR", "1") != "0"


def pack_weight(weight: torch.Tensor, quantized: QuantizedWeight | QuantizedParts | None = None) -> PackedWeight | None:
    """The weight laid out for the decode-sized matmul, or None where packing does not apply
    (non-fp32 weights, neither the kernel nor oneDNN available, or packing turned off).
    `quantized`: the same weight as the checkpoint's blocks, packed as such where the kernel builds."""
    if weight.dtype != torch.float32 or not packing_enabled():
        return None
    weight = weight.detach()
    quant_kernel = quant_gemm() if quantized is not None else None
    if quant_kernel is not None and isinstance(quantized, QuantizedParts):
        if quantized.out_features != weight.shape[0] or quantized.in_features != weight.shape[1]:
            raise ValueError(f"blocks of {quantized.out_features} x {quantized.in_features} weights do not match "
                             f"the fp32 shape {tuple(weight.shape)}")
        parts = tuple(_pack_blocks(quant_kernel, p) for p in quantized.parts)
        return PackedWeight(torch.empty(0, dtype=torch.uint8), weight.shape[0], "parts", parts)
    if quant_kernel is not None and isinstance(quantized, QuantizedWeight):
        if quantized.blocks.shape[0] != weight.shape[0] or quantized.in_features != weight.shape[1]:
            raise ValueError(f"{quantized.qtype} blocks of a {tuple(quantized.blocks.shape)} weight do not match "
                             f"its fp32 shape {tuple(weight.shape)}")
        return _pack_blocks(quant_kernel, quantized)
    kernel = panel_gemm()
    if kernel is not None:
        return PackedWeight(kernel.pack_panels(weight), weight.shape[0], "panels")  # type: ignore[attr-defined]
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_ROWS_HINT), weight.shape[0], "onednn")
    except (AttributeError, RuntimeError):  # a torch without the op: the plain path still works
        return None


def _pack_blocks(quant_kernel: object, quantized: QuantizedWeight) -> PackedWeight:
    data = quant_kernel.pack_quantized(quantized.blocks, KERNEL_QTYPE[quantized.qtype])  # type: ignore[attr-defined]
    return PackedWeight(data, quantized.blocks.shape[0], quantized.qtype)


Matmul = Callable[[torch.Tensor, torch.Tensor, PackedWeight | None, torch.Tensor | None], torch.Tensor]


def matmul_path() -> Matmul:
    """`linear` with its switches (CONVEYOR_PACKED_LINEAR, CONVEYOR_KERNELS) read now: the model
    resolves it once per forward pass, not on each of a step's ~120 products."""
    packing, kernel, quant_kernel = packing_enabled(), panel_gemm(), quant_gemm()

    def product(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        if (packing and packed is not None and x.dtype == torch.float32 and x.dim() == 2
                and x.shape[0] < PLAIN_FROM_ROWS[packed.layout]):
            y = packed_product(x, packed, bias, kernel, quant_kernel)
            if y is not None:
                return y
        return F.linear(x, weight, bias)
    return product


def linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    return matmul_path()(x, weight, packed, bias)


def packed_product(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, kernel: object | None,
                   quant_kernel: object | None = None) -> torch.Tensor | None:
    """None when the panel kernel (`kernel`, from panel_gemm(); `quant_kernel` from quant_gemm())
    was turned off after packing (CONVEYOR_KERNELS=0 in an A/B run)."""
    if packed.layout == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    if packed.layout == "parts":
        if quant_kernel is None:
            return None
        outputs, start = [], 0
        for part in packed.parts:  # each column's sum is its own: the parts' products side by side are the whole's
            part_bias = None if bias is None else bias[start : start + part.out_features]
            outputs.append(quant_kernel.quantized_matmul(x, part.data, part.out_features, part_bias,  # type: ignore[attr-defined]
                                                         KERNEL_QTYPE[part.layout]))
            start += part.out_features
        return torch.cat(outputs, dim=1)
    if packed.layout in KERNEL_QTYPE:
        if quant_kernel is None:
            return None
        qtype = KERNEL_QTYPE[packed.layout]
        return quant_kernel.quantized_matmul(x, packed.data, packed.out_features, bias, qtype)  # type: ignore[attr-defined]
    return None if kernel is None else kernel.panel_matmul(x, packed.data, packed.out_features, bias)  # type: ignore[attr-defined]


# Past this many candidate columns a row's screened argmax gives up and the full product runs
# (a row whose logits are all within the int8 pass's bound of each other: rare; all-zero x does it).
MAX_SCREENED_CANDIDATES = 4096


def screened_argmax(x: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor | None:
    """argmax(x @ W^T, -1) of a Q8_0-packed W without the full fp32 product (quant_gemm.cpp's
    q8_0_argmax: an int8 pass bounds every logit, the few columns that can be the maximum are
    computed exactly): the same indices as the full product's argmax. None where it does not apply
    (another layout, no AVX-512 VNNI/VBMI build, kernels or packing off, CONVEYOR_SCREENED_ARGMAX=0,
    non-finite x, or so many rows that the full product would run F.linear instead of the blocks)."""
    if packed is None or packed.layout != "Q8_0" or not packing_enabled() or x.dtype != torch.float32 or x.dim() != 2:
        return None
    if x.shape[0] >= PLAIN_FROM_ROWS[packed.layout]:
        return None
    if os.environ.get("CONVEYOR_SCREENED_ARGMAX", "1") == "0":
        return None
    kernel = quant_gemm()
    screen = getattr(kernel, "q8_0_argmax", None)
    if screen is None or x.shape[0] == 0 or not bool(torch.isfinite(x).all()):
        return None
    tokens = screen(x, packed.data, packed.out_features, MAX_SCREENED_CANDIDATES)
    gave_up = tokens < 0
    if bool(gave_up.any()):
        full = packed_product(x[gave_up], packed, None, None, kernel)
        assert full is not None  # the kernel that screened is the one that multiplies
        tokens[gave_up] = full.argmax(dim=-1)
    return tokens


class Linear(nn.Linear):
    """nn.Linear that, once `pack()` is called after loading, runs on its packed weight (from the
    checkpoint's blocks where `quantized` holds them). The plain weight stays (tied embeddings,
    prefill, export, the CONVEYOR_PACKED_LINEAR=0 path)."""

    packed: PackedWeight | None = None
    quantized: QuantizedWeight | QuantizedParts | None = None  # the checkpoint's blocks, set by the loader before pack()

    def pack(self) -> None:
        self.packed = pack_weight(self.weight, self.quantized)

    def forward(self, x: torch.Tensor, matmul: Matmul | None = None) -> torch.Tensor:
        return (matmul or matmul_path())(x, self.weight, self.packed, self.bias)
