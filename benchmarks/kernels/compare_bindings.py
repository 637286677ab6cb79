"""Every kernel function run on the same inputs through another checkout's torch-bound kernels (torch
tensors in, torch's extension builder) and through this tree's numpy-bound ones, compared byte for byte.

The inputs are made here once and written as .npy files; two subprocesses (one per side, one after the
other) read them, call every function of every module on them and write what comes back, and what the
call changed in place (the residual, qkv and the KV caches, a product's `out`), as .npy files; this
process then compares the two sides' files: dtype, shape and bytes. A call that raises on both sides
must raise the same type with the same message. Both sides run the same thread count (--threads).

    python benchmarks/kernels/compare_bindings.py --torch-tree /work/main [--threads 2] [--keep DIR]

The torch side builds its kernels into TORCH_EXTENSIONS_DIR (default here: a folder under the work
directory, so that the user's cache is left alone).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

# GGML type numbers and their blocks: (weights, bytes) per block, and the byte offsets of each block's
# fp16 (BF16: bf16) fields.
QTYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
          "Q5_K": 13, "Q6_K": 14, "BF16": 30}
BLOCKS = {"F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q8_0": (32, 34), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
          "Q6_K": (256, 210)}
HALF_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2],
                "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108]}
INT8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
UNIT_K = {t: 32 if t in ("F16", "BF16") else BLOCKS[t][0] for t in QTYPES}


class Cases:
    """Calls to make, with their inputs saved under `folder`. An argument is a saved array (optionally
    indexed: a view of it), a plain value, or None."""

    def __init__(self, folder: Path, rng: np.random.Generator) -> None:
        self.folder, self.rng = folder, rng
        self.calls: list[dict[str, Any]] = []
        self.arrays = 0

    def array(self, a: np.ndarray, index: list[list[int] | None] | None = None) -> dict[str, Any]:
        """`index`: per dimension, None or [start, stop(, step)]: the argument is that view of `a`."""
        name = f"in{self.arrays}.npy"
        self.arrays += 1
        np.save(self.folder / name, np.ascontiguousarray(a))
        return {"file": name, "index": index}

    def add(self, module: str, function: str, args: list[Any], kwargs: dict[str, Any] | None = None,
            changed: tuple[int, ...] = (), note: str = "") -> None:
        """`changed`: positions of array arguments the call writes into, compared after it."""
        self.calls.append({"id": len(self.calls), "module": module, "function": function, "args": args,
                           "kwargs": kwargs or {}, "changed": list(changed), "note": note})

    def randn(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)


def random_blocks(qtype: str, rows: int, k: int, rng: np.random.Generator, wild: bool) -> np.ndarray:
    """uint8 [rows, k / weights * bytes]: random code bytes; fp16 fields finite (any bit pattern when
    `wild`, else scales near 0.01); F16 / BF16 weights alike."""
    def halves(n: int, brain: bool) -> np.ndarray:
        if wild:
            bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
            exponent = 0x7F80 if brain else 0x7C00
            bits[(bits & exponent) == exponent] &= 0xBFFF
            return bits
        values = rng.uniform(-0.05, 0.05, n).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16) if brain else values.astype(np.float16).view(np.uint16)

    if qtype in ("F16", "BF16"):
        return halves(rows * k, qtype == "BF16").view(np.uint8).reshape(rows, -1)
    weights, nbytes = BLOCKS[qtype]
    n = rows * k // weights
    raw = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    for offset in HALF_OFFSETS[qtype]:
        raw[:, offset:offset + 2] = halves(n, False).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def with_outliers(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A feature in about one group of 32 in five made 5-500x larger (carried exactly by the int8 kernel)."""
    groups = x.reshape(x.shape[0], -1, 32).copy()
    chosen = rng.random(groups.shape[:2]) < 0.2
    places = rng.integers(0, 32, groups.shape[:2])
    factor = np.exp(rng.uniform(np.log(5), np.log(500), groups.shape[:2])).astype(np.float32)
    r, c = np.nonzero(chosen)
    groups[r, c, places[r, c]] *= factor[r, c]
    return groups.reshape(x.shape)


def fused_ops_cases(c: Cases) -> None:
    m = "fused_ops"
    for rows in (1, 7, 300):  # 300 rows: split across threads
        wide = c.randn(rows, 700, scale=3.0)
        weight = c.randn(576)
        c.add(m, "rms_norm", [c.array(wide, [None, [0, 576]]), c.array(weight), 1e-5], note=f"{rows} strided rows")
        c.add(m, "add_rms_norm_", [c.array(wide, [None, [0, 576]]), c.array(c.randn(rows, 576)), c.array(weight), 1e-6],
              changed=(0,), note=f"{rows} rows")
    for cache_dtype in (np.float32, np.float16):
        for head_dim, heads, kv_heads in ((64, 9, 3), (16, 4, 2), (128, 8, 8), (6, 2, 1), (256, 4, 1), (64, 14, 2)):
            for norms in (False, True):
                rows, block_size, blocks = 11, 4, 8
                qkv = c.randn(rows, (heads + 2 * kv_heads) * head_dim, scale=3.0)
                positions = np.array([0, 5, 63, 1, 2, 3, 4, 30, 31, 32, 7])
                inv = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
                angles = np.concatenate([positions[:, None] * inv[None]] * 2, axis=1).astype(np.float32)
                slots = c.rng.permutation(blocks * block_size)[:rows].astype(np.int64)
                caches = [np.zeros((blocks, block_size, kv_heads, head_dim), dtype=cache_dtype) for _ in range(2)]
                q_norm = c.array(c.randn(head_dim) + 1.0) if norms else None
                k_norm = c.array(c.randn(head_dim) + 1.0) if norms else None
                c.add(m, "rope_and_cache", [c.array(qkv), c.array(np.cos(angles)), c.array(np.sin(angles)),
                                            c.array(caches[0]), c.array(caches[1]), c.array(slots), heads, kv_heads,
                                            q_norm, k_norm, 1e-6],
                      changed=(0, 3, 4),
                      note=f"{np.dtype(cache_dtype).name} cache, d {head_dim}, {heads}/{kv_heads} heads, qk-norms {norms}")
    for rows, width in ((1, 1536), (33, 1536), (300, 4864)):
        gate_up = c.randn(rows, 2 * width + 8, scale=8.0)
        gate_up[0, :4] = [-100.0, 100.0, 0.0, -0.0]
        c.add(m, "silu_and_mul", [c.array(gate_up, [None, [0, 2 * width]])], note=f"{rows} strided rows")
    for rows, vocab in ((1, 262144), (7, 49152), (3, 37), (2, 1), (4, 33)):
        logits = c.randn(rows, vocab + 5)
        if vocab > 40:
            logits[0, 17] = np.nan
            logits[-1, 3] = logits[-1, 30] = 1e9
        c.add(m, "argmax_rows", [c.array(logits, [None, [0, vocab]])], note=f"{rows} x {vocab}")
    c.add(m, "rms_norm", [c.array(c.randn(2, 8).astype(np.float64)), c.array(np.ones(8, np.float32)), 1e-6],
          note="refused: float64")
    c.add(m, "rope_and_cache", [c.array(c.randn(1, 24)), c.array(np.ones((1, 8), np.float32)),
                                c.array(np.zeros((1, 8), np.float32)), c.array(np.zeros((2, 4, 1, 8), np.float32)),
                                c.array(np.zeros((2, 4, 1, 8), np.float32)), c.array(np.array([8])), 1, 1, None, None,
                                1e-6], changed=(3, 4), note="refused: slot out of range")


def decode_case(c: Cases, lens: list[int], block_size: int, heads: int, kv_heads: int, head_dim: int,
                dtype: type, share: bool) -> tuple[list[Any], str]:
    blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache: np.ndarray = c.randn(blocks, block_size, kv_heads, head_dim).astype(dtype)
    v_cache: np.ndarray = c.randn(blocks, block_size, kv_heads, head_dim).astype(dtype)
    order = c.rng.permutation(blocks).tolist()
    width, tables, used = max(-(-n // block_size) for n in lens), [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(order[used:used + count] + [0] * (width - count))
        used += count
    if share:
        for t in tables[1:]:
            t[0] = tables[0][0]
    q = c.randn(len(lens), heads, head_dim)
    args = [c.array(q), c.array(k_cache), c.array(v_cache), c.array(np.array(tables, dtype=np.int64)),
            c.array(np.array(lens, dtype=np.int64)), head_dim**-0.5]
    return args, f"{np.dtype(dtype).name} cache, lens {lens}, d {head_dim}, {heads}/{kv_heads} heads, blocks of {block_size}"


def paged_decode_cases(c: Cases) -> None:
    m, f = "paged_decode", "paged_decode_attention"
    for dtype in (np.float32, np.float16):
        for head_dim, heads, kv_heads, block_size in ((16, 6, 2, 4), (64, 9, 3, 16), (128, 8, 2, 16), (256, 4, 1, 16),
                                                      (24, 2, 1, 16), (80, 10, 2, 16)):
            for lens, window, share in (([1], 0, False), ([37], 0, False), ([1500], 0, False),
                                        ([5, 1, 17, 8, 300, 70], 0, False), ([300, 9], 7, False),
                                        ([64, 3, 33, 4, 4, 120], 50, True), ([300, 290, 37], 0, True),
                                        ([1000, 1, 1, 1], 0, False)):
                args, note = decode_case(c, lens, block_size, heads, kv_heads, head_dim, dtype, share)
                for span in ("auto", "token", "vector") if share or head_dim == 64 else ("auto",):
                    c.add(m, f, [*args, window], {"unshared_span": span},
                          note=f"{note}, window {window}, shared first block {share}, span {span}")
    args, _ = decode_case(c, [8, 3], 4, 6, 2, 16, np.float32, False)
    c.add(m, f, args, {"unshared_span": "tiles"}, note="refused: unknown span")
    args[4] = c.array(np.array([8, 99], dtype=np.int64))
    c.add(m, f, args, note="refused: context longer than its table")


def paged_prefill_cases(c: Cases) -> None:
    m, f = "paged_prefill", "paged_prefill_attention"
    for dtype in (np.float32, np.float16):
        for d, heads, kv_heads, block_size in ((64, 9, 3, 16), (128, 8, 2, 16), (256, 4, 1, 16), (64, 8, 8, 5),
                                               (128, 32, 1, 16), (64, 14, 2, 1)):
            for num_cached, num_tokens, window in ((0, 1, 0), (0, 37, 0), (0, 200, 0), (45, 70, 0), (1024, 9, 0),
                                                   (30, 20, 17), (100, 7, 40), (0, 50, 1)):
                total = num_cached + num_tokens
                used = -(-total // block_size)
                k_cache = c.randn(used + 2, block_size, kv_heads, d, scale=3.0).astype(dtype)
                v_cache = c.randn(used + 2, block_size, kv_heads, d).astype(dtype)
                table = c.rng.permutation(used + 2)[:used]
                # int32 tables are converted by the kernel (torch: .to(kLong))
                table_dtype = np.int32 if (num_cached + d) % 3 == 0 else np.int64
                q = c.randn(num_tokens, heads, d)
                c.add(m, f, [c.array(q), c.array(k_cache), c.array(v_cache), c.array(table.astype(table_dtype)),
                             num_cached, d**-0.5, window],
                      note=f"{np.dtype(dtype).name} cache, d {d}, {heads}/{kv_heads} heads, blocks of {block_size}, "
                           f"{num_cached} cached + {num_tokens}, window {window}, {np.dtype(table_dtype).name} table")
    q = c.randn(10, 4, 64)
    caches = [c.array(c.randn(4, 16, 2, 64)) for _ in range(2)]
    c.add(m, f, [c.array(q), *caches, c.array(np.array([0, 99])), 10, 0.1, 0], note="refused: block id out of range")
    c.add(m, f, [c.array(q), *caches, c.array(np.array([0])), 10, 0.1, 0], note="refused: block table too short")


def panel_gemm_cases(c: Cases) -> None:
    m = "panel_gemm"
    for n, k in ((576, 576), (40, 128), (136, 96), (1536, 576), (192, 576)):
        weight = c.randn(n, k)
        c.add(m, "pack_panels", [c.array(weight)], note=f"[{n}, {k}]")
        packed = c.array(np.concatenate([weight, np.zeros((-n % 16, k), np.float32)]).reshape(-1, 16, k).transpose(0, 2, 1))
        bias = c.array(c.randn(n))
        for rows in (1, 2, 3, 5, 7, 13, 33, 64, 131):
            x = c.randn(rows, k + 3)
            for b in (None, bias):
                c.add(m, "panel_matmul", [c.array(x, [None, [0, k]]), packed, n, b],
                      note=f"[{n}, {k}], {rows} strided rows, bias {b is not None}")
    wide = c.randn(48, 128)
    c.add(m, "pack_panels", [c.array(wide, [None, [0, 128, 2]])], note="a weight whose columns lie 2 apart")
    packed = c.array(c.randn(3, 64, 16))
    for rows in (1, 9):
        c.add(m, "panel_matmul", [c.array(c.randn(rows, 128), [None, [0, 128, 2]]), packed, 40, c.array(c.randn(40))],
              note=f"{rows} rows whose features lie 2 apart")


def quant_gemm_cases(c: Cases) -> None:
    m = "quant_gemm"
    for qtype, code in QTYPES.items():
        unit = UNIT_K[qtype]
        k = 3 * unit if unit == 256 else 4 * unit
        for n in (40, 48, 136):
            wild = c.array(random_blocks(qtype, n, k, c.rng, wild=True))
            c.add(m, "pack_quantized", [wild, code], note=f"{qtype} [{n}, {k}] wild scales")
            c.add(m, "column_norms", [{"packed_from": wild, "qtype": code}, n, code], note=f"{qtype} [{n}, {k}]")
            ids = c.array(np.array([n - 1, 0, 15, 16, n - 1, 5, 31, 32, 0], dtype=np.int64))
            c.add(m, "dequantize_rows", [{"packed_from": wild, "qtype": code}, n, ids, code], note=f"{qtype} rows")
            c.add(m, "dequantize_rows", [{"packed_from": wild, "qtype": code}, n,
                                         c.array(np.arange(n, dtype=np.int64)), code], note=f"{qtype} all rows")
            sane = c.array(random_blocks(qtype, n, k, c.rng, wild=False))
            bias = c.array(c.randn(n))
            for rows in (1, 2, 3, 4, 5, 7, 10, 11, 13, 24, 25, 33, 131):
                x = c.randn(rows, k + 1)
                for b in (None, bias) if rows in (1, 4, 13, 131) else (bias,):
                    c.add(m, "quantized_matmul", [c.array(x, [None, [0, k]]), {"packed_from": sane, "qtype": code}, n, b,
                                                  code], note=f"{qtype} [{n}, {k}], {rows} rows, bias {b is not None}")
        big = random_blocks(qtype, 64, k, c.rng, wild=True)  # packed a run of 16 rows at a time into one array
        units = k // unit
        panel_bytes = {"Q4_0": 288, "Q4_1": 320, "Q5_0": 352, "Q5_1": 384, "Q8_0": 544, "Q4_K": 2368, "Q5_K": 2880,
                       "Q6_K": 3360, "Q2_K": 2624, "Q3_K": 2336, "F16": 1024, "BF16": 1024}[qtype]
        out = c.array(np.full((4, units, panel_bytes), 0xAB, dtype=np.uint8))
        c.add(m, "pack_quantized_into", [c.array(big, [[16, 32], None]), code, {**out, "index": [[1, 2], None, None]}],
              changed=(2,), note=f"{qtype}, into panel 1 of 4")
    for k in (2048,):  # fused tiles from K = 2048 on AVX-512 builds
        for qtype in ("Q4_K", "Q8_0", "Q6_K", "BF16"):
            sane = c.array(random_blocks(qtype, 40, k, c.rng, wild=False))
            for rows in (25, 33, 64, 65):
                c.add(m, "quantized_matmul", [c.array(c.randn(rows, k)), {"packed_from": sane, "qtype": QTYPES[qtype]}, 40,
                                              c.array(c.randn(40)), QTYPES[qtype]], note=f"{qtype} K {k}, {rows} rows")
    for n in (1000, 993, 1007):  # the screened argmax of a Q8_0 head
        sane = c.array(random_blocks("Q8_0", n, 320, c.rng, wild=False))
        for rows in (1, 5, 8, 9, 17, 33):
            x = c.randn(rows, 320)
            x[:, 7] *= 50.0
            c.add(m, "q8_0_argmax", [c.array(x), {"packed_from": sane, "qtype": 8}, n, 64], note=f"N {n}, {rows} rows")
        c.add(m, "q8_0_argmax", [c.array(np.zeros((2, 320), np.float32)), {"packed_from": sane, "qtype": 8}, n, 16],
              note=f"N {n}, too many candidates")
    q = c.array(random_blocks("Q4_1", 32, 64, c.rng, wild=False))
    c.add(m, "quantized_matmul", [c.array(c.randn(2, 96)), {"packed_from": q, "qtype": 3}, 32, None, 3],
          note="refused: features")
    c.add(m, "pack_quantized", [q, 23], note="refused: qtype")
    c.add(m, "dequantize_rows", [{"packed_from": q, "qtype": 3}, 32, c.array(np.array([32])), 3], note="refused: row")


def quant_int8_cases(c: Cases) -> None:
    m = "quant_int8"
    for name in ("bf16_tiles", "bf16_dot", "isa"):
        c.add(m, name, [], note="a fact of the build")
    c.add(m, "outlier_ratio", [], note="attribute")
    for rows, k in ((7, 256), (1, 4096), (40, 576)):
        x = with_outliers(c.randn(rows, k) * np.logspace(-3, 3, k, dtype=np.float32), c.rng)
        x[0, 32:64] = 0.0
        c.add(m, "quantize_activations", [c.array(x)], note=f"[{rows}, {k}]")
    for qtype in INT8_TYPES:
        code = QTYPES[qtype]
        for rows, k in ((1, 512), (2, 512), (3, 512), (4, 512), (5, 512), (13, 512), (40, 512), (230, 4096)):
            if BLOCKS[qtype][0] == 256 and k % 256:
                continue
            n = 37
            sane = c.array(random_blocks(qtype, n, k, c.rng, wild=False))
            x = with_outliers(c.randn(rows, k), c.rng)
            for b in (None, c.array(c.randn(n))):
                c.add(m, "int8_matmul", [c.array(x), {"packed_from": sane, "qtype": code}, n, b, code],
                      note=f"{qtype} [{n}, {k}], {rows} rows, bias {b is not None}")
        sane = c.array(random_blocks(qtype, 40, 256, c.rng, wild=False))
        out = c.array(np.full((26, 40), 7.0, np.float32))
        c.add(m, "int8_matmul", [c.array(with_outliers(c.randn(20, 256), c.rng), [[3, 20], None]),
                                 {"packed_from": sane, "qtype": code}, 40, c.array(c.randn(40)), code],
              {"out": {**out, "index": [[5, 22], None]}}, changed=(), note=f"{qtype}, out= rows 5-21 of 26")
        c.calls[-1]["changed_kwargs"] = ["out"]
        c.add(m, "bf16_tile_matmul", [c.array(c.randn(2, 256)), {"packed_from": sane, "qtype": code}, 40, None, code],
              note="AMX tiles (refused without them)")
    for qtype in ("BF16", "F16"):
        code = QTYPES[qtype]
        for rows, k, n in ((1, 32, 37), (5, 512, 37), (12, 512, 80), (13, 512, 80), (16, 96, 17), (40, 512, 20),
                           (40, 4096, 200)):
            sane = c.array(random_blocks(qtype, n, k, c.rng, wild=False))
            x = with_outliers(c.randn(rows, k + 32), c.rng)
            for b in (None, c.array(c.randn(n))):
                c.add(m, "bf16_dot_matmul", [c.array(x, [None, [0, k]]), {"packed_from": sane, "qtype": code}, n, b, code],
                      note=f"{qtype} [{n}, {k}], {rows} strided rows, bias {b is not None}")
    q = c.array(random_blocks("Q8_0", 16, 64, c.rng, wild=False))
    c.add(m, "int8_matmul", [c.array(c.randn(2, 96)), {"packed_from": q, "qtype": 8}, 16, None, 8], note="refused: features")
    c.add(m, "int8_matmul", [c.array(c.randn(2, 64)), {"packed_from": q, "qtype": 8}, 16, None, 1], note="refused: qtype")


def make_cases(folder: Path) -> list[dict[str, Any]]:
    c = Cases(folder, np.random.default_rng(0))
    for make in (fused_ops_cases, paged_decode_cases, paged_prefill_cases, panel_gemm_cases, quant_gemm_cases,
                 quant_int8_cases):
        make(c)
    return c.calls


def run_side(side: str, folder: Path, out: Path, threads: int) -> None:
    """Runs every call on this interpreter's conveyor (torch tensors when `side` is "torch")."""
    from conveyor.model import kernels

    as_torch = side == "torch"
    if as_torch:
        import torch

        torch.set_num_threads(threads)
    else:
        kernels.set_num_threads(threads)
    calls = json.loads((folder / "calls.json").read_text())
    modules: dict[str, Any] = {}
    packed_cache: dict[tuple[str, int], Any] = {}
    bases: dict[str, np.ndarray] = {}

    def base(file: str) -> np.ndarray:
        if file not in bases:
            bases[file] = np.load(folder / file)
        return bases[file]

    def convert(arg: Any) -> Any:
        if isinstance(arg, dict) and "packed_from" in arg:  # a weight packed by this side's pack_quantized
            key = (arg["packed_from"]["file"], arg["qtype"])
            if key not in packed_cache:
                packed_cache[key] = modules["quant_gemm"].pack_quantized(convert(arg["packed_from"]), arg["qtype"])
            return packed_cache[key]
        if isinstance(arg, dict):
            whole = base(arg["file"])
            value: Any = torch.from_numpy(whole) if as_torch else whole
            if arg["index"] is not None:
                value = value[tuple(slice(*i) if i is not None else slice(None) for i in arg["index"])]
            return value
        return arg

    def to_numpy(value: Any) -> Any:
        if as_torch and isinstance(value, torch.Tensor):
            return value.detach().contiguous().numpy()
        return value

    results: dict[str, Any] = {}
    for call in calls:
        if call["module"] not in modules:
            modules[call["module"]] = kernels._load(call["module"])
        module = modules[call["module"]]
        key = str(call["id"])
        try:
            target = getattr(module, call["function"])
            if not callable(target):
                results[key] = {"value": repr(target)}
                continue
            args = [convert(a) for a in call["args"]]
            kwargs = {name: convert(a) for name, a in call["kwargs"].items()}
            returned = target(*args, **kwargs)
        except Exception as exc:  # compared too: both sides must refuse alike
            results[key] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        outputs = list(returned) if isinstance(returned, (tuple, list)) else [returned]
        changed = [call["args"][i] for i in call["changed"]] + [call["kwargs"][n] for n in call.get("changed_kwargs", [])]
        record: dict[str, Any] = {"outputs": [], "changed": []}
        for i, value in enumerate(outputs):
            value = to_numpy(value)
            if isinstance(value, np.ndarray):
                np.save(out / f"{key}_out{i}.npy", value)
                record["outputs"].append(f"{key}_out{i}.npy")
            else:
                record["outputs"].append({"value": repr(value)})
        for i, arg in enumerate(changed):  # the whole array an argument lies in
            np.save(out / f"{key}_changed{i}.npy", base(arg["file"]))
            record["changed"].append(f"{key}_changed{i}.npy")
            bases.pop(arg["file"])  # later calls read the inputs as saved
        results[key] = record
    (out / "results.json").write_text(json.dumps(results))


def same(a: Path, b: Path) -> bool:
    x, y = np.load(a), np.load(b)
    return x.dtype == y.dtype and x.shape == y.shape and np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes()


def compare(folder: Path) -> int:
    calls = json.loads((folder / "calls.json").read_text())
    sides = {side: json.loads((folder / side / "results.json").read_text()) for side in ("torch", "numpy")}
    tally: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    failures = 0
    for call in calls:
        key, name = str(call["id"]), f"{call['module']}.{call['function']}"
        a, b = sides["torch"][key], sides["numpy"][key]
        if "error" in a or "error" in b or "value" in a or "value" in b:
            ok = a == b
        else:
            ok = len(a["outputs"]) == len(b["outputs"]) and len(a["changed"]) == len(b["changed"])
            for x, y in zip(a["outputs"] + a["changed"], b["outputs"] + b["changed"]):
                if isinstance(x, dict) or isinstance(y, dict):
                    ok &= x == y
                else:
                    ok &= same(folder / "torch" / x, folder / "numpy" / y)
        tally[name][0] += ok
        tally[name][1] += 1
        if not ok:
            failures += 1
            print(f"DIFFERENT {name} ({call['note']}): torch {a} / numpy {b}")
        elif "error" in a:
            print(f"same refusal {name} ({call['note']}): {a['error']}")
    for name, (good, total) in tally.items():
        print(f"{name}: {good}/{total} identical")
    print("all identical" if not failures else f"{failures} call(s) differ")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-tree", type=Path, help="the checkout with the torch-bound kernels (e.g. /work/main)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    parser.add_argument("--side", choices=["torch", "numpy"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        out = args.folder / args.side
        out.mkdir(exist_ok=True)
        run_side(args.side, args.folder, out, args.threads)
        return
    if args.torch_tree is None:
        parser.error("--torch-tree is required")
    folder = args.keep or Path(tempfile.mkdtemp(prefix="compare-bindings-"))
    folder.mkdir(parents=True, exist_ok=True)
    calls = make_cases(folder)
    (folder / "calls.json").write_text(json.dumps(calls))
    print(f"{len(calls)} calls, inputs in {folder}", flush=True)
    here = Path(__file__).resolve().parents[2]
    for side, tree in (("torch", args.torch_tree.resolve()), ("numpy", here)):
        env = {**os.environ, "PYTHONPATH": str(tree)}
        env.setdefault("TORCH_EXTENSIONS_DIR", str(folder / "torch_extensions"))
        subprocess.run([sys.executable, __file__, "--side", side, "--folder", str(folder), "--threads", str(args.threads)],
                       env=env, check=True)
    failures = compare(folder)
    if args.keep is None and not failures:
        import shutil

        shutil.rmtree(folder)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
