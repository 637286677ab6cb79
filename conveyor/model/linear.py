"""Linear layers and the token embedding, each weight held once, in the form that serves it.

A weight the checkpoint stores in GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K) or as
16-bit floats (F16, BF16: a GGUF tensor, or an HF folder's weights served in fp32) lives only in that
form, laid out in panels of 16 output columns (kernels/quant_gemm.cpp): a product expands them to
fp32 in registers (a few rows) or a panel at a time into an L2-sized buffer (more rows), with
results bit-identical to dequantize-then-multiply; the embedding looks up rows by expanding just
their panels; a tied output head multiplies by the embedding's own blocks. An untied embedding is
never multiplied by, so it keeps the file's own row-major blocks (left in its memory map). With
activation_dtype "int8" (the default) products on the same bytes are faster and approximate
(kernels/quant_int8.cpp): x quantized to int8 against integer blocks, x rounded to bf16 against
16-bit float weights (F16 ones rounded to bf16 too) on CPUs with AVX512-BF16.

A dense fp32 weight (an fp32 HF folder, a GGUF F32 tensor) lives as fp32 panels
(kernels/panel_gemm.cpp), which read each weight once as one stream; where that kernel can't be
built, as a plain fp32 array that numpy's matmul takes. Served with dtype bfloat16, a matrix is held
as bf16 (its 16 bits, numpy having no bfloat16) in the BF16 panels of the 16-bit float path above,
and multiplied by fp32 activations (or bf16-rounded ones, with activation_dtype "int8" on
AVX512-BF16): activations are fp32 whatever the weights' dtype.

Whether to pack is decided when a weight is loaded (CONVEYOR_PACKED_LINEAR=0 or CONVEYOR_KERNELS=0
keep plain dense weights: A/B runs, debugging); a weight held only packed then always runs on its
kernel. Plain weights take the numpy reference products (`reference_product`): fp32 x @ W^T, a
bf16 weight expanded to fp32 first (dequantize, then multiply).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from conveyor.model import kernels
from conveyor.model.kernels import panel_gemm, quant_gemm
from conveyor.model.quantized import (HALF_TYPES, INT8_TYPES, KERNEL_QTYPE, KERNEL_UNIT_K, PANEL_UNIT_BYTES,
                                     QuantizedWeight, bf16_bits, bf16_to_float32)

# With int8 activations, a product on blocks of a type takes the integer kernel (quant_int8.cpp) from
# this many rows. Measured, the integer kernel is no slower at one row for every type (docs/PERF.md,
# "Integer products"), so all are 1; that also keeps a row's result independent of its batch (each
# row is quantized and multiplied alone), which greedy equality under batching, chunked prefill and
# speculation rely on. A threshold above 1 would trade that away. 16-bit float weights (BF16, F16)
# take x rounded to bf16 instead, at every row count, where the CPU has AVX512-BF16 (quant_int8.cpp's
# bf16_dot_matmul); Q2_K and Q3_K keep fp32 activations.
INT8_FROM_ROWS: dict[str, int] = {qtype: 1 for qtype in INT8_TYPES}

# The weights' dtypes a model is served in (EngineConfig.dtype): "float32" holds every matrix the
# file does not keep in its own form as fp32 panels, "bfloat16" as BF16 panels (activations fp32).
WEIGHT_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PackedWeight:
    data: np.ndarray
    out_features: int
    # "panels": conveyor's fp32 panels; a KERNEL_QTYPE key: GGUF blocks (or 16-bit floats) in panels;
    # "parts": row ranges in different block types, each in `parts` (data is empty)
    layout: str
    parts: tuple[PackedWeight, ...] = ()
    # Every weight finite (the screened argmax's bound needs it); known for Q8_0 blocks from their scales.
    finite: bool = True

    @property
    def nbytes(self) -> int:
        """The bytes a product streams."""
        return sum(p.nbytes for p in self.parts) if self.parts else int(self.data.nbytes)

    @property
    def in_features(self) -> int:
        if self.parts:
            return self.parts[0].in_features
        if self.layout == "panels":
            return int(self.data.shape[1])
        return int(self.data.shape[1]) * KERNEL_UNIT_K[self.layout]

    @staticmethod
    def cat(parts: list[PackedWeight]) -> PackedWeight:
        """The row-wise concatenation (fused q/k/v, gate/up). Runs of one layout whose rows fill
        whole panels join into one weight (its panels one after another, no new layout); where
        layouts differ, or a part ends inside a panel, the parts run side by side."""
        if not parts:
            raise ValueError("nothing to concatenate")
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("the parts of a fused weight must have the same in_features")
        flat = [q for p in parts for q in (p.parts or (p,))]
        merged: list[PackedWeight] = []
        for p in flat:
            last = merged[-1] if merged else None
            if last is not None and last.layout == p.layout and last.out_features % PANEL == 0:
                joined = aligned_empty((last.data.shape[0] + p.data.shape[0], *p.data.shape[1:]), p.data.dtype)
                np.concatenate([last.data, p.data], out=joined)
                merged[-1] = PackedWeight(joined, last.out_features + p.out_features, p.layout,
                                          finite=last.finite and p.finite)
            else:
                merged.append(p)
        if len(merged) == 1:
            return merged[0]
        return PackedWeight(np.empty(0, dtype=np.uint8), sum(p.out_features for p in merged), "parts",
                            tuple(merged), all(p.finite for p in merged))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of the weight, in fp32 [len(ids), in_features] (an embedding lookup)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self.layout == "panels":  # [panels, K, 16]: row i is panel i // 16's column i % 16
            return self.data[ids // PANEL, :, ids % PANEL]
        if self.layout in KERNEL_QTYPE:
            return _quant_kernel().dequantize_rows(self.data, self.out_features, ids, KERNEL_QTYPE[self.layout])  # type: ignore[attr-defined]
        raise ValueError(f"rows of a {self.layout!r} weight are not looked up")


PANEL = 16  # output columns a panel holds (kernels/panel_tile.h's kPanel)
CACHE_LINE = 64


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A new C-contiguous array whose data starts on a cache line, as the kernels' own outputs (and
    torch's tensors) do. numpy's start 16 bytes past one: a weight's panels streamed from there
    split every vector load of the stream across two lines."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + CACHE_LINE, dtype=np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def packing_enabled() -> bool:
    return os.environ.get("CONVEYOR_PACKED_LINEAR", "1") != "0"


def blocks_kept() -> bool:
    """Whether a weight in GGUF blocks stays in them when loaded (packed, or read by rows), rather
    than dequantized: packing on and the block kernel built."""
    return packing_enabled() and quant_gemm() is not None


def _quant_kernel() -> object:
    """quant_gemm for a weight held only in blocks: it runs there whatever CONVEYOR_KERNELS says now."""
    kernel = quant_gemm(force=True)
    if kernel is None:
        raise RuntimeError("a weight held in GGUF blocks needs the quant_gemm kernel, which failed to build")
    return kernel


# Rows packed at a time: a loader drops each run's file pages before the next (`taken`), so a load
# holds one run's pages beside the panels, not a whole matrix's (a 7B's output head is ~0.4 GiB).
PACK_RUN_BYTES = 8 << 20


def pack_blocks(quantized: QuantizedWeight, taken: Callable[[int, int], None] | None = None) -> PackedWeight | None:
    """The checkpoint's blocks in panels, or None where they stay dense (the kernel can't be built,
    packing is turned off, or in_features is not whole units: the caller then dequantizes). Packed
    a run of whole panels at a time; `taken(first_row, end_row)` is told each run once it is packed."""
    if not blocks_kept() or not quantized.kernel_reads():
        return None
    kernel, qtype = _quant_kernel(), KERNEL_QTYPE[quantized.qtype]
    rows, row_bytes = quantized.blocks.shape
    data = aligned_empty(((rows + PANEL - 1) // PANEL, quantized.in_features // KERNEL_UNIT_K[quantized.qtype],
                          PANEL_UNIT_BYTES[quantized.qtype]), np.dtype(np.uint8))
    run = max(PANEL, PACK_RUN_BYTES // max(row_bytes, 1) // PANEL * PANEL)
    finite = True
    for first in range(0, rows, run):
        part = QuantizedWeight(quantized.qtype, quantized.blocks[first:first + run])
        kernel.pack_quantized_into(part.blocks, qtype, data[first // PANEL:(first + run + PANEL - 1) // PANEL])  # type: ignore[attr-defined]
        finite = finite and part.finite()
        if taken is not None:
            taken(first, min(rows, first + run))
    return PackedWeight(data, rows, quantized.qtype, finite=finite)


def pack_weight(weight: np.ndarray, quantized: QuantizedWeight | None = None) -> PackedWeight | None:
    """The fp32 weight laid out for the panel kernel, or None where packing does not apply
    (non-fp32 weights, the kernel not built, or packing turned off: the weight then stays a plain
    array). `quantized`: the same weight as the checkpoint's blocks, packed as such where the block
    kernel builds."""
    if weight.dtype != np.float32 or not packing_enabled():
        return None
    if quantized is not None:
        if quantized.blocks.shape[0] != weight.shape[0] or quantized.in_features != weight.shape[1]:
            raise ValueError(f"{quantized.qtype} blocks of a {tuple(quantized.blocks.shape)} weight do not match "
                             f"its fp32 shape {tuple(weight.shape)}")
        if (packed := pack_blocks(quantized)) is not None:
            return packed
    kernel = panel_gemm()
    if kernel is None:
        return None
    weight = np.ascontiguousarray(weight)
    return PackedWeight(kernel.pack_panels(weight), weight.shape[0], "panels",  # type: ignore[attr-defined]
                        finite=bool(np.isfinite(weight).all()))


Matmul = Callable[[np.ndarray, "np.ndarray | None", "PackedWeight | None", "np.ndarray | None"], np.ndarray]


@dataclass(frozen=True)
class PromptRows:
    """The rows of a step's products that compute prompt tokens, where those take the bf16 tile
    kernel (quant_int8.cpp's bf16_tile_matmul) and the other rows, generated tokens, the int8
    kernel. Chosen by a token's origin, never by how many rows a step has, so a token's result does
    not depend on its batch: a prompt token computes the same on the tiles whatever else runs, a
    generated token the same on the int8 kernel, in a decode, a speculative verification or a
    recompute after preemption alike."""

    num_rows: int
    ranges: tuple[tuple[int, int], ...]  # the prompt rows, as runs [start, end), ascending
    others: tuple[tuple[int, int], ...]  # the rest, likewise

    @classmethod
    def of(cls, ranges: tuple[tuple[int, int], ...], num_rows: int) -> "PromptRows | None":
        """From row ranges [start, end) (AttentionMetadata.prompt_rows: disjoint, none empty); None
        when there are none (a decode step)."""
        if not ranges:
            return None
        ordered, others, at = tuple(sorted(ranges)), [], 0
        for start, end in ordered:
            if start > at:
                others.append((at, start))
            at = end
        if at < num_rows:
            others.append((at, num_rows))
        return cls(num_rows, ordered, tuple(others))

    @property
    def every_row(self) -> bool:
        return not self.others


def bf16_tiles_available() -> bool:
    """Whether this CPU and build run the bf16 tile kernel (AMX-BF16, and the OS lends the tiles)."""
    module = int8_matmul_kernel()
    return module is not None and bool(module.bf16_tiles())  # type: ignore[attr-defined]


def bf16_dot_available() -> bool:
    """Whether this CPU and build multiply 16-bit float weights by bf16 activations (AVX512-BF16),
    which activation_dtype "int8" then takes for them."""
    module = int8_matmul_kernel()
    return module is not None and _has_bf16_dot(module)


@functools.cache
def _has_bf16_dot(module: object) -> bool:
    """The build's answer, asked once: products ask it for every 16-bit weight of every step."""
    return bool(module.bf16_dot())  # type: ignore[attr-defined]


def reference_product(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x @ W^T (+ b) in numpy on a plain weight: fp32, or bf16 bits (uint16) expanded to fp32 first
    (dequantize, then multiply). What a weight runs on where no kernel holds it (CONVEYOR_KERNELS=0,
    CONVEYOR_PACKED_LINEAR=0, a kernel that failed to build), and what tests compare kernels with."""
    w = weight if weight.dtype == np.float32 else bf16_to_float32(weight) if weight.dtype == np.uint16 \
        else weight.astype(np.float32)
    y = np.matmul(x, w.T)
    if bias is not None:
        y += bias
    return y


def matmul_path(activation_dtype: str = "float32", prompt_rows: PromptRows | None = None) -> Matmul:
    """`linear` with its switches (CONVEYOR_PACKED_LINEAR, CONVEYOR_KERNELS) read now: the model
    resolves it once per forward pass, not on each of a step's ~120 products. `activation_dtype`:
    "int8" lets products on GGUF blocks quantize their activations where that is faster, and
    products on 16-bit float weights round them to bf16 where the CPU has AVX512-BF16.
    `prompt_rows` (int8 only): the step's prompt rows, which then take the bf16 tiles."""
    packing, kernel, quant_kernel = packing_enabled(), panel_gemm(), quant_gemm()
    int8_kernel = int8_matmul_kernel() if activation_dtype == "int8" else None
    tiles = prompt_rows if int8_kernel is not None else None

    def product(x: np.ndarray, weight: np.ndarray | None, packed: PackedWeight | None,
                bias: np.ndarray | None = None) -> np.ndarray:
        if packed is not None and x.dtype == np.float32 and x.ndim == 2:
            # A product takes the rows its PromptRows counts: one run of a step's rows, with its own
            # PromptRows (llama.row_runs); any other would take the int8 kernel for all of its rows.
            rows = tiles if tiles is not None and tiles.num_rows == x.shape[0] else None
            if weight is None:  # held only packed: its kernel, whatever the switches say now
                y = packed_product(x, packed, bias, panel_gemm(force=True), _quant_kernel(), int8_kernel, rows)
                assert y is not None
                return y
            if packing:
                y = packed_product(x, packed, bias, kernel, quant_kernel, int8_kernel, rows)
                if y is not None:
                    return y
        if weight is None:
            raise ValueError(f"a packed weight takes 2-D fp32 input, not {x.dtype} of {x.ndim} dimensions")
        return reference_product(x, weight, bias)
    return product


def linear(x: np.ndarray, weight: np.ndarray | None, packed: PackedWeight | None,
           bias: np.ndarray | None = None) -> np.ndarray:
    return matmul_path()(x, weight, packed, bias)


def int8_matmul_kernel() -> object | None:
    """quant_int8.cpp's module where it builds (AVX-512 VNNI or AVX2), else None: int8 activations
    then fall back to the exact fp32 path."""
    return kernels.quant_int8()


def packed_product(x: np.ndarray, packed: PackedWeight, bias: np.ndarray | None, kernel: object | None,
                   quant_kernel: object | None = None, int8_kernel: object | None = None,
                   prompt_rows: PromptRows | None = None) -> np.ndarray | None:
    """None when the kernel a layout needs (`kernel` from panel_gemm(), `quant_kernel` from
    quant_gemm()) is turned off. `int8_kernel` (int8_matmul_kernel()): products on blocks with at
    least INT8_FROM_ROWS rows quantize x to int8 and multiply in integers, but for `prompt_rows`
    (x's rows that compute prompt tokens), which take its bf16 tiles; products on BF16 and F16
    weights round x (and F16 weights) to bf16 (where the build has AVX512-BF16)."""
    if packed.layout == "parts":
        outputs, start = [], 0
        for part in packed.parts:  # each column's sum is its own: the parts' products side by side are the whole's
            part_bias = None if bias is None else bias[start : start + part.out_features]
            y = packed_product(x, part, part_bias, kernel, quant_kernel, int8_kernel, prompt_rows)
            if y is None:
                return None
            outputs.append(y)
            start += part.out_features
        return np.concatenate(outputs, axis=1)
    if packed.layout in KERNEL_QTYPE:
        qtype = KERNEL_QTYPE[packed.layout]
        if packed.layout in HALF_TYPES and int8_kernel is not None and _has_bf16_dot(int8_kernel):
            return int8_kernel.bf16_dot_matmul(x, packed.data, packed.out_features, bias, qtype)  # type: ignore[attr-defined]
        int8_from = INT8_FROM_ROWS.get(packed.layout)
        if int8_kernel is not None and int8_from is not None and prompt_rows is not None:
            return _by_origin(x, packed, bias, qtype, int8_kernel, prompt_rows)
        if int8_kernel is not None and int8_from is not None and x.shape[0] >= int8_from:
            return int8_kernel.int8_matmul(x, packed.data, packed.out_features, bias, qtype)  # type: ignore[attr-defined]
        if quant_kernel is None:
            return None
        return quant_kernel.quantized_matmul(x, packed.data, packed.out_features, bias, qtype)  # type: ignore[attr-defined]
    return None if kernel is None else kernel.panel_matmul(x, packed.data, packed.out_features, bias)  # type: ignore[attr-defined]


def _by_origin(x: np.ndarray, packed: PackedWeight, bias: np.ndarray | None, qtype: int, int8_kernel: object,
               prompt_rows: PromptRows) -> np.ndarray:
    """x @ W^T with the prompt rows on the bf16 tiles and the others on the int8 kernel."""
    tiles = int8_kernel.bf16_tile_matmul  # type: ignore[attr-defined]
    if prompt_rows.every_row:
        return tiles(x, packed.data, packed.out_features, bias, qtype)
    # Each run of rows is multiplied in place and written into its rows of y: gathering a kind's
    # rows and scattering its result cost a third of a large product again (docs/PERF.md).
    y = np.empty((x.shape[0], packed.out_features), dtype=np.float32)
    for kernel, runs in ((tiles, prompt_rows.ranges), (int8_kernel.int8_matmul, prompt_rows.others)):  # type: ignore[attr-defined]
        for start, end in runs:
            kernel(x[start:end], packed.data, packed.out_features, bias, qtype, out=y[start:end])
    return y


# Past this many candidate columns a row's screened argmax gives up and the full product runs
# (a row whose logits are all within the approximate pass's bound of each other: rare; all-zero x
# does it).
MAX_SCREENED_CANDIDATES = 4096
# Rows the screen takes at a time: each holds a few [rows, vocabulary] fp32 temporaries
# (~20 MB apiece for 32 rows of a 152k vocabulary), not a whole large batch's.
SCREEN_ROWS = 32
# A 16-bit float head (BF16, F16) is screened from this many rows: below, its exact product reads
# the same bytes as the bf16 pass and is about as fast, so the screen's own passes would be a loss
# (docs/PERF.md).
HALF_SCREEN_FROM_ROWS = 8


def screened_argmax(x: np.ndarray, packed: PackedWeight | None,
                    column_norms: np.ndarray | None = None) -> np.ndarray | None:
    """argmax(x @ W^T, -1) of a vocabulary projection on GGUF blocks (or 16-bit floats) without the
    full fp32 product: an approximate pass gives every column a logit and a bound on its distance
    from the fp32 one, and only the columns that can be the maximum are computed exactly, so the
    indices are the full product's. A Q8_0 W takes quant_gemm.cpp's q8_0_argmax (AVX-512 VNNI/VBMI
    builds); any layout the int8 kernel reads takes the int8 product and `column_norms`
    (`screen_norms(W)`, None for any other), on AVX2 too; BF16 / F16 the bf16 product (AVX512-BF16). None
    where neither applies (no norms, weights not all finite, CONVEYOR_SCREENED_ARGMAX=0, non-finite
    x). int64 [rows]."""
    if packed is None or not packed.finite or x.dtype != np.float32 or x.ndim != 2 or x.shape[0] == 0:
        return None
    if os.environ.get("CONVEYOR_SCREENED_ARGMAX", "1") == "0":
        return None
    kernel = _quant_kernel()
    screen = getattr(kernel, "q8_0_argmax", None) if packed.layout == "Q8_0" else None
    # screen_norms gives norms only where a screen applies; norms kept beside another layout (a
    # weight swapped in an A/B run) are not this weight's
    if screen is None and (column_norms is None or not _screens(packed.layout)):
        return None
    if packed.layout in HALF_TYPES and x.shape[0] < HALF_SCREEN_FROM_ROWS:
        return None
    if not bool(np.isfinite(x).all()):
        return None
    if screen is not None:
        tokens = np.asarray(screen(x, packed.data, packed.out_features, MAX_SCREENED_CANDIDATES), dtype=np.int64)
    else:
        assert column_norms is not None
        tokens = np.concatenate([_screened_argmax_in_rows(x[first:first + SCREEN_ROWS], packed, column_norms, kernel)
                                 for first in range(0, x.shape[0], SCREEN_ROWS)])
    gave_up = tokens < 0
    if bool(gave_up.any()):
        full = packed_product(np.ascontiguousarray(x[gave_up]), packed, None, None, kernel)
        assert full is not None  # the kernel that screened is the one that multiplies
        tokens[gave_up] = full.argmax(axis=-1)
    return tokens


def screen_norms(packed: PackedWeight | None) -> np.ndarray | None:
    """Each column's L2 norm (fp32, rounded up): what `screened_argmax` bounds a column's error
    with, for a vocabulary projection in blocks the int8 kernel reads (or 16-bit floats). None where
    that screen does not apply (then the full product runs, or q8_0_argmax): Q8_0, whose fp32
    product reads its codes as bytes and is about as fast as the int8 one (docs/PERF.md, "Greedy's
    head on any block type"), layouts the int8 kernel does not read (BF16 and F16 are screened by
    the bf16 product where the CPU has AVX512-BF16), no int8 build, weights not all finite."""
    if packed is None or not packed.finite or not _screens(packed.layout):
        return None
    norms = np.asarray(_quant_kernel().column_norms(packed.data, packed.out_features,  # type: ignore[attr-defined]
                                                    KERNEL_QTYPE[packed.layout]), dtype=np.float64)
    if not bool(np.isfinite(norms).all()):
        return None
    return (norms * (1 + 2.0**-20)).astype(np.float32)  # fp64 -> fp32 rounds to nearest: up by more than that


def _screens(layout: str) -> bool:
    """Whether `screen_candidates` has an approximate product for weights of this layout here."""
    kernel = int8_matmul_kernel()
    if kernel is None:
        return False
    if layout in HALF_TYPES:
        return _has_bf16_dot(kernel)
    return layout in INT8_TYPES and layout != "Q8_0"


def _gamma(n: int) -> float:
    """n u / (1 - n u), u = 2^-24: the relative error bound of an n-term fp32 sum."""
    return n * 2.0**-24 / (1 - n * 2.0**-24)


def screen_candidates(x: np.ndarray, packed: PackedWeight, column_norms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(candidates [rows, N] bool, finite [rows] bool): the columns that can hold each row's maximum
    of the fp32 product x @ W^T, and the rows whose approximate logits are all finite (a row with an
    overflowed one says nothing). The approximate product is the one activation_dtype "int8" takes:
    on integer blocks the int8 kernel's (quant_int8.cpp: x in groups of 32, scale max|x| / 127,
    rounded to nearest, a lone large feature carried exactly), on 16-bit float weights the bf16 one
    (x rounded to 8 significant bits, a subnormal to 0, and F16 weights rounded so too). It differs
    from the exact one by sum_k w_k e_k, e being x's rounding: in int8 |e_k| <= max|x_g| / 254 in
    group g (|x_k| in a group below the kernel's zero threshold), in bf16 |e_k| <= 2^-8 |x_k| or
    2^-126; by Cauchy-Schwarz, by at most |w_col| |e|; an F16 weight's rounding adds at most
    2^-8 |w_col| |x + e|. Both products' fp32 rounding adds at most a few gamma_n of
    |w_col| (|x| + |e|) (a block's minimum no larger than its largest weight, as quantisers choose
    it); the bound takes 16 times that, and a subnormal product or sum flushed to zero (vdpbf16ps)
    at most 2^-126 each, as a subnormal weight (2^-126 |x_k|). A candidate's upper bound reaches the
    row's largest lower bound. The bounds are computed in float64, rounded up to fp32 once."""
    qtype = KERNEL_QTYPE[packed.layout]
    kernel = int8_matmul_kernel()
    rows, k_dim = x.shape
    xd = x.astype(np.float64)
    x_norm = np.sqrt(np.einsum("ij,ij->i", xd, xd))
    if packed.layout in HALF_TYPES:
        approx = kernel.bf16_dot_matmul(x, packed.data, packed.out_features, None, qtype)  # type: ignore[attr-defined]
        err = x_norm * (2.0**-8 * 1.001) + k_dim**0.5 * 2.0**-126
        if packed.layout == "F16":  # the weights' rounding, over x + e
            err = err + (x_norm + err) * (2.0**-8 * 1.001)
    else:
        approx = kernel.int8_matmul(x, packed.data, packed.out_features, None, qtype)  # type: ignore[attr-defined]
        group_max = np.abs(xd.reshape(rows, k_dim // 32, 32)).max(axis=-1)
        per_group = np.where(group_max < 1e-30, group_max, group_max / 254)  # the kernel zeroes a tiny group
        err = np.sqrt(np.square(per_group).sum(axis=-1) * 32) * 1.001  # fp32 scale and x * (127 / max) rounding
    rounding = 16 * (_gamma(k_dim) + _gamma(k_dim // 32 + 8)) * (x_norm + err)
    scale = ((err + rounding) * (1 + 2.0**-20)).astype(np.float32)
    if packed.layout in HALF_TYPES:
        # bf16's bound is small enough that the largest column norm serves every column: three
        # passes over approx instead of seven (they would cost more than the product saves).
        # |approx| <= |w_col| (|x| + |e|) bounds its own rounding; vdpbf16ps flushes a subnormal
        # weight to zero (at most 2^-126 |x_k| each: sqrt(K) 2^-126 |x| in all) and a subnormal
        # product or sum (2^-126 each).
        widest = float(column_norms.max())
        slack_rows = (widest * (scale.astype(np.float64) + 2.0**-19 * x_norm) * (1 + 2.0**-20)
                      + k_dim**0.5 * 2.0**-126 * 1.004 * x_norm + 2 * k_dim * 2.0**-126).astype(np.float32)
        largest = approx.max(axis=-1)  # NaN if any logit is: no candidate, the row gives up
        candidates = approx >= (largest - 2 * slack_rows)[:, None]
        return candidates, np.isfinite(largest) & np.isfinite(approx.min(axis=-1))
    bound = column_norms[None, :] * scale[:, None]
    slack = bound * np.float32(1 + 2.0**-20)
    slack += np.abs(approx) * np.float32(2.0**-20)  # the fp32 rounding of approx +- bound
    lower_max = (approx - slack).max(axis=-1)
    candidates = (approx + slack) >= lower_max[:, None]  # NaN (an overflowed approx) is never >=: a row gives up
    return candidates, np.isfinite(approx.max(axis=-1)) & np.isfinite(approx.min(axis=-1))


def _screened_argmax_in_rows(x: np.ndarray, packed: PackedWeight, column_norms: np.ndarray,
                             quant_kernel: object) -> np.ndarray:
    """Each row's argmax of the fp32 product, -1 where it has more than MAX_SCREENED_CANDIDATES
    (screen_candidates). The candidates are computed by quant_gemm's own product on just their panels,
    bit for bit the full product's (a column's sum does not depend on its neighbours: isa_check's
    builds, which tile panels differently, agree on it)."""
    qtype = KERNEL_QTYPE[packed.layout]
    candidates, finite = screen_candidates(x, packed, column_norms)
    rows = x.shape[0]
    counts = np.count_nonzero(candidates, axis=-1)
    tokens = np.full(rows, -1, dtype=np.int64)
    screened = (counts > 0) & (counts <= MAX_SCREENED_CANDIDATES) & finite
    if not bool(screened.any()):
        return tokens
    # From the screened rows' candidate indices (a few a row): passes over their [rows, N] mask
    # cost more than the product they save.
    row_of, column_of = np.nonzero(candidates[screened])
    panels = np.unique(column_of // PANEL)
    exact = quant_kernel.quantized_matmul(np.ascontiguousarray(x[screened]), packed.data[panels],  # type: ignore[attr-defined]
                                          len(panels) * PANEL, None, qtype)
    columns = (panels[:, None] * PANEL + np.arange(PANEL)).reshape(-1)
    mask = np.zeros(exact.shape, dtype=np.bool_)
    mask[row_of, np.searchsorted(panels, column_of // PANEL) * PANEL + column_of % PANEL] = True
    tokens[screened] = columns[np.where(mask, exact, np.float32(-np.inf)).argmax(axis=-1)]
    return tokens

WeightSource = np.ndarray | QuantizedWeight | PackedWeight


def held_once(weight: WeightSource, dtype: str = "float32") -> tuple[np.ndarray | None, PackedWeight | None]:
    """(plain, packed) for a loaded matrix, exactly one of them set: blocks already packed stay
    so; raw blocks are packed (or dequantized where the kernel is missing); a dense fp32 weight is
    packed where the panel kernel takes it. With dtype "bfloat16" a matrix not packed already is
    rounded to bf16 and held as BF16 panels (its bits, uint16 [out, in], where the kernel can't
    take it). Anything else stays a plain fp32 array."""
    if isinstance(weight, PackedWeight):
        return None, weight
    if isinstance(weight, QuantizedWeight):
        packed = pack_blocks(weight) if dtype == "float32" or weight.qtype == "BF16" else None
        if packed is not None:
            return None, packed
        if dtype == "bfloat16" and weight.qtype == "BF16":
            return weight.halves(), None
        weight = weight.dequantize()
    if dtype == "bfloat16":
        bits = bf16_bits(weight)
        packed = pack_blocks(QuantizedWeight.of_halves(bits, "BF16")) if bits.ndim == 2 else None
        return (None, packed) if packed is not None else (bits, None)
    if dtype != "float32":
        raise ValueError(f"weights are held in one of {WEIGHT_DTYPES}, not {dtype!r}")
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    packed = pack_weight(weight)
    return (None, packed) if packed is not None else (weight, None)


class Linear:
    """y = x W^T (+ b) on a weight held once (`held_once`): packed for a kernel, or plain."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.weight: np.ndarray | None = None  # plain: fp32, or bf16 bits (uint16)
        self.packed: PackedWeight | None = None
        self.bias: np.ndarray | None = np.zeros(out_features, dtype=np.float32) if bias else None

    def load(self, weight: WeightSource, dtype: str = "float32") -> None:
        plain, packed = held_once(weight, dtype)
        if plain is not None:
            shape = tuple(plain.shape)
        else:
            assert packed is not None
            shape = (packed.out_features, packed.in_features)
        if shape != (self.out_features, self.in_features):
            raise ValueError(f"a {shape} weight for a {self.out_features} x {self.in_features} projection")
        self.weight, self.packed = plain, packed

    @property
    def nbytes(self) -> int:
        """What the weight (and bias) hold."""
        held = self.packed.nbytes if self.packed is not None else 0
        held += int(self.weight.nbytes) if self.weight is not None else 0
        return held + (int(self.bias.nbytes) if self.bias is not None else 0)

    def forward(self, x: np.ndarray, matmul: Matmul | None = None) -> np.ndarray:
        return (matmul or matmul_path())(x, self.weight, self.packed, self.bias)

    __call__ = forward


class Embedding:
    """Token embedding on a weight held once: rows dequantized from blocks or read from panels
    (the same weight a tied output head multiplies by), or a plain table (fp32, or bf16 bits). An
    untied embedding in GGUF blocks is only ever read by rows, so it keeps the checkpoint's own
    blocks (`blocks`, a view of the memory-mapped file when loaded from one): only the pages of rows
    looked up become resident, as under llama.cpp's mmap, instead of a packed copy of the whole
    vocabulary. Rows come out in fp32."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight: np.ndarray | None = None
        self.packed: PackedWeight | None = None
        self.blocks: QuantizedWeight | None = None

    def load(self, weight: WeightSource, dtype: str = "float32", rows_only: bool = False) -> None:
        """`rows_only`: no output head multiplies by this weight (the checkpoint has its own)."""
        if (rows_only and isinstance(weight, QuantizedWeight) and (dtype == "float32" or weight.qtype == "BF16")
                and blocks_kept() and weight.kernel_reads()):
            if weight.blocks.shape[0] != self.num_embeddings or weight.in_features != self.embedding_dim:
                raise ValueError(f"{weight.qtype} blocks of {weight.blocks.shape[0]} x {weight.in_features} weights "
                                 f"for a {self.num_embeddings} x {self.embedding_dim} embedding")
            self.weight, self.packed, self.blocks = None, None, weight
            return
        self.weight, self.packed = held_once(weight, dtype)
        self.blocks = None

    @property
    def nbytes(self) -> int:
        """What the weight holds at most (blocks left in a file's mapping: once every row is read)."""
        if self.blocks is not None:
            return int(self.blocks.blocks.nbytes)
        if self.packed is not None:
            return self.packed.nbytes
        assert self.weight is not None
        return int(self.weight.nbytes)

    def forward(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if self.blocks is not None:
            return block_rows(self.blocks, ids).reshape(*ids.shape, self.embedding_dim)
        if self.weight is not None:
            rows = self.weight[ids.reshape(-1)]
            rows = bf16_to_float32(rows) if rows.dtype == np.uint16 else rows
            return rows.reshape(*ids.shape, self.embedding_dim)
        assert self.packed is not None
        return self.packed.rows(ids).reshape(*ids.shape, self.embedding_dim)

    __call__ = forward


def block_rows(quantized: QuantizedWeight, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a weight in the checkpoint's row-major blocks, in fp32 [len(ids), in_features]:
    just those rows' bytes are copied out, laid into panels and expanded by the kernel that expands
    packed weights, so the values are the ones a packed copy would give, bit for bit."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    rows = quantized.blocks.shape[0]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise IndexError(f"row ids must be in [0, {rows}): got {int(ids.min())} .. {int(ids.max())}")
    kernel, qtype = _quant_kernel(), KERNEL_QTYPE[quantized.qtype]
    panels = kernel.pack_quantized(quantized.blocks[ids], qtype)  # type: ignore[attr-defined]
    return kernel.dequantize_rows(panels, ids.size, np.arange(ids.size, dtype=np.int64), qtype)  # type: ignore[attr-defined]
