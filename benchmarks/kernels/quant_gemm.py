"""A decode step's products, cold: the GGUF's own blocks vs dense fp32 panels, per block type.

Three sets of products, each packed both ways: as quantised panels (kernels/quant_gemm.cpp) and
as the same weights dequantised to fp32 panels (kernels/panel_gemm.cpp):
- default: the shipped SmolLM2-135M's real weights, fused as the model runs them (QKV, O,
  gate/up, down; 30 layers; Q4_1) and its Q8_0 vocabulary projection;
- `--gguf PATH`: every matrix of a GGUF file (e.g. the Gemma 3 270M Q4_K_M: Q5_0, Q4_K, Q6_K,
  Q8_0), one product each, timed per block type;
- `--types Q4_K Q5_K ...`: random blocks of each type (any code bytes, scales near 0.01) in the
  shapes of `--layers` layers of a 1B-class model (hidden 2048, MLP 8192, 32 + 8 + 8 heads of 64:
  QKV 3072 x 2048, O 2048 x 2048, gate/up 16384 x 2048, down 2048 x 8192; 61M weights a layer).
Times one pass over a set's products at each row count, the two layouts alternated repeat by
repeat so drift hits both alike, and checks the outputs are bit-identical. `--clock cpu` (one
thread) times the thread's CPU time instead of the wall clock: on a machine shared with busy
processes the wall clock mostly measures the time the thread waits for a core. `--baseline REV`
times the block kernel as it stood at a git revision in place of the dense panels (a kernel
change; same packed layout, and the results must stay bit-identical).

    python benchmarks/kernels/quant_gemm.py --rows 1 2 3 4 5 8 10 12 16 32 --repeats 7
    python benchmarks/kernels/quant_gemm.py --types Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K --rows 1 8 32
    python benchmarks/kernels/quant_gemm.py --gguf /tmp/gemma3/gemma-3-270m-q4_k_m.gguf --rows 1 8 32
    python benchmarks/kernels/quant_gemm.py --baseline HEAD~1 --rows 1 2 4 --repeats 9
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator

import numpy as np
from kernel_at import kernel_at

from conveyor.model.kernels import panel_gemm, quant_gemm
from conveyor.model.quantized import BLOCK_SIZES, KERNEL_QTYPE, QuantizedWeight
from conveyor.model.threads import set_num_threads

# The model's fused products, by the GGUF's tensor names (blk.N.<name>.weight)
FUSED = [["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate", "ffn_up"], ["ffn_down"]]
LAYER_SHAPES_1B = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # (out, in)
HALF_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
                "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108],
                "F16": [0], "BF16": [0]}

Product = tuple[int, int, np.ndarray, np.ndarray, str]  # out, in, fp32 panels, block panels, qtype


def pack(weight: np.ndarray, q: QuantizedWeight) -> Product:
    dense, blocks = panel_gemm(), quant_gemm()
    return (weight.shape[0], weight.shape[1], dense.pack_panels(np.ascontiguousarray(weight, dtype=np.float32)),  # type: ignore[union-attr]
            blocks.pack_quantized(q.blocks, KERNEL_QTYPE[q.qtype]), q.qtype)  # type: ignore[union-attr]


def gguf_fp32(q: QuantizedWeight) -> np.ndarray:
    return q.dequantize()  # gguf's dequantiser, fp32 [out, in]


def smollm2_products() -> dict[str, list[Product]]:
    from conveyor.model.gguf_loader import _blocks, read_gguf
    from conveyor.model.loader import resolve_model_path

    gf = read_gguf(resolve_model_path(None))
    layers = 1 + max(int(name.split(".")[1]) for name in gf.tensors if name.startswith("blk."))
    products = []
    for i in range(layers):
        for group in FUSED:
            parts = [_blocks(gf, gf.tensors[f"blk.{i}.{n}.weight"]) for n in group]
            assert all(q is not None and q.qtype == parts[0].qtype for q in parts)  # type: ignore[union-attr]
            blocks = QuantizedWeight(parts[0].qtype, np.concatenate([q.blocks for q in parts]))  # type: ignore[union-attr]
            products.append(pack(gguf_fp32(blocks), blocks))
    head = _blocks(gf, gf.tensors["token_embd.weight"])  # tied: the vocabulary projection
    assert head is not None
    products.append(pack(gguf_fp32(head), head))
    return {"SmolLM2-135M step (Q4_1 + Q8_0 head)": products}


def gguf_products(path: str) -> dict[str, list[Product]]:
    from conveyor.model.gguf_loader import _blocks, dequantize, read_gguf

    gf = read_gguf(path)
    by_type: dict[str, list[Product]] = {}
    for t in gf.tensors.values():
        q = _blocks(gf, t)
        if q is not None:
            by_type.setdefault(q.qtype, []).append(pack(dequantize(gf, t), q))
    return by_type


def synthetic_products(types: list[str], layers: int) -> Iterator[tuple[str, list[Product]]]:
    rng = np.random.default_rng(0)
    for qtype in types:
        weights, nbytes = BLOCK_SIZES[qtype]
        products = []
        for _ in range(layers):
            for n, k in LAYER_SHAPES_1B:
                raw = rng.integers(0, 256, (n * k // weights, nbytes), dtype=np.uint8)
                for offset in HALF_OFFSETS[qtype]:
                    scales = rng.uniform(-0.02, 0.02, raw.shape[0]).astype(np.float16)
                    raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
                q = QuantizedWeight(qtype, raw.reshape(n, -1))
                products.append(pack(gguf_fp32(q), q))
        yield f"{qtype}, {layers} x 1B-class layer", products


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def one_pass(products: list[Product], rows: int, blocks: object | None, clock: str) -> tuple[float, list[np.ndarray]]:
    """One pass on the dense panels (blocks None) or on the block panels with the kernel `blocks`."""
    dense_kernel = panel_gemm()
    xs = {k: np.random.default_rng(k).standard_normal((rows, k), dtype=np.float32) for k in {p[1] for p in products}}
    now = CLOCKS[clock]
    start, outs = now(), []
    for n, k, dense, quant, qtype in products:
        if blocks is not None:
            outs.append(blocks.quantized_matmul(xs[k], quant, n, None, KERNEL_QTYPE[qtype]))  # type: ignore[attr-defined]
        else:
            outs.append(dense_kernel.panel_matmul(xs[k], dense, n, None))  # type: ignore[union-attr]
    return (now() - start) * 1e3, outs


def report(title: str, products: list[Product], rows_list: list[int], repeats: int, clock: str,
           baseline: tuple[str, object] | None) -> None:
    dense_mb = sum(p[2].nbytes for p in products) / 1e6
    block_mb = sum(p[3].nbytes for p in products) / 1e6
    print(f"\n{title}: {len(products)} products, dense fp32 panels {dense_mb:.0f} MB, block panels {block_mb:.0f} MB")
    other = f"blocks at {baseline[0]}" if baseline else "dense"
    print(f"rows | {clock} clock: {other} ms (median, min) | blocks ms (median, min) | {other} / blocks | bit-identical")
    for rows in rows_list:
        other_ms, block_ms, same = [], [], True
        for _ in range(repeats):
            t, other_out = one_pass(products, rows, baseline[1] if baseline else None, clock)
            other_ms.append(t)
            t, block_out = one_pass(products, rows, quant_gemm(), clock)
            block_ms.append(t)
            same &= all(np.array_equal(a, b) for a, b in zip(other_out, block_out))
        d, b = statistics.median(other_ms), statistics.median(block_ms)
        print(f"{rows:4d} | {d:7.1f} {min(other_ms):7.1f} | {b:7.1f} {min(block_ms):7.1f} | {d / b:5.2f}x | {same}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 10, 12, 16, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="cpu: the thread's CPU time (needs --num-threads 1)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--gguf", default=None, help="every matrix of this GGUF file, per block type")
    source.add_argument("--types", nargs="+", choices=list(BLOCK_SIZES), help="random blocks in 1B-class layer shapes")
    parser.add_argument("--layers", type=int, default=2, help="with --types: layers per type")
    parser.add_argument("--baseline", help="git revision whose block kernel to time in place of the dense panels")
    args = parser.parse_args()
    if args.clock == "cpu" and args.num_threads != 1:
        parser.error("--clock cpu times the calling thread: use --num-threads 1")
    set_num_threads(args.num_threads)
    if panel_gemm() is None or quant_gemm() is None:
        raise SystemExit("the panel kernels are not built here (x86 with AVX2, FMA and F16C, and a C++ compiler)")
    if args.types:
        sets: Iterator[tuple[str, list[Product]]] = synthetic_products(args.types, args.layers)
    elif args.gguf:
        sets = iter(sorted(gguf_products(args.gguf).items()))
    else:
        sets = iter(smollm2_products().items())
    baseline = (args.baseline, kernel_at(args.baseline, "quant_gemm")) if args.baseline else None
    if baseline is not None:
        baseline[1].set_num_threads(args.num_threads)  # type: ignore[attr-defined]
    for title, products in sets:
        report(title, products, args.rows, args.repeats, args.clock, baseline)


if __name__ == "__main__":
    main()
