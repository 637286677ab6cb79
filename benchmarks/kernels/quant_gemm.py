"""Every product of one SmolLM2-135M decode step, cold: the GGUF's own blocks vs dense fp32 panels.

Packs the shipped model's real weights both ways: its Q4_1 projections (fused QKV, O, fused
gate/up, down; 30 layers) and Q8_0 vocabulary projection as quantised panels
(kernels/quant_gemm.cpp, 96 MB), and the same weights dequantised to fp32 panels
(kernels/panel_gemm.cpp, 538 MB). Times one pass over all of them at each row count, the two
alternated repeat by repeat so drift hits both alike, and checks the outputs are bit-identical.

    python benchmarks/quant_gemm.py --rows 1 2 3 4 5 8 10 12 16 32 --repeats 7
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from conveyor.model.kernels import panel_gemm, quant_gemm
from conveyor.model.loader import load_checkpoint
from conveyor.model.quantized import KERNEL_QTYPE, QuantizedWeight

FUSED = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
         ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 10, 12, 16, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    dense_kernel, block_kernel = panel_gemm(), quant_gemm()
    if dense_kernel is None or block_kernel is None:
        raise SystemExit("the panel kernels are not built here (x86 with AVX2, FMA and F16C, and a C++ compiler)")
    ckpt = load_checkpoint(None)
    products = []  # (out features, in features, fp32 panels, block panels, qtype)
    for i in range(ckpt.config.num_layers):
        for group in FUSED:
            names = [f"model.layers.{i}.{n}.weight" for n in group]
            weight = torch.cat([ckpt.weights[n] for n in names])
            blocks = QuantizedWeight.cat([ckpt.quantized[n] for n in names])
            products.append((weight.shape[0], weight.shape[1], dense_kernel.pack_panels(weight),
                             block_kernel.pack_quantized(blocks.blocks, KERNEL_QTYPE[blocks.qtype]), blocks.qtype))
    head, head_blocks = ckpt.weights["model.embed_tokens.weight"], ckpt.quantized["model.embed_tokens.weight"]
    products.append((head.shape[0], head.shape[1], dense_kernel.pack_panels(head),
                     block_kernel.pack_quantized(head_blocks.blocks, KERNEL_QTYPE[head_blocks.qtype]), head_blocks.qtype))
    dense_mb = sum(p[2].numel() * 4 for p in products) / 1e6
    block_mb = sum(p[3].numel() for p in products) / 1e6
    print(f"{len(products)} products: dense fp32 panels {dense_mb:.0f} MB, GGUF block panels {block_mb:.0f} MB")

    def one_pass(rows: int, blocks: bool) -> tuple[float, list[torch.Tensor]]:
        xs = {k: torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) for k in (576, 1536)}
        start, outs = time.perf_counter(), []
        for n, k, dense, quant, qtype in products:
            if blocks:
                outs.append(block_kernel.quantized_matmul(xs[k], quant, n, None, KERNEL_QTYPE[qtype]))
            else:
                outs.append(dense_kernel.panel_matmul(xs[k], dense, n, None))
        return (time.perf_counter() - start) * 1e3, outs

    print("rows | dense ms (median, min) | blocks ms (median, min) | dense / blocks | bit-identical")
    for rows in args.rows:
        dense_ms, block_ms, same = [], [], True
        for _ in range(args.repeats):
            t, dense_out = one_pass(rows, False)
            dense_ms.append(t)
            t, block_out = one_pass(rows, True)
            block_ms.append(t)
            same &= all(torch.equal(a, b) for a, b in zip(dense_out, block_out))
        d, b = statistics.median(dense_ms), statistics.median(block_ms)
        print(f"{rows:4d} | {d:7.1f} {min(dense_ms):7.1f} | {b:7.1f} {min(block_ms):7.1f} | {d / b:5.2f}x | {same}", flush=True)


if __name__ == "__main__":
    main()
