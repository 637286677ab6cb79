"""Engine decode steps on fp32 weights packed at load vs plain `F.linear` (MKL on the plain weight).

The packed path is the panel kernel (kernels/panel_gemm.cpp), or oneDNN where it cannot be built.

Whole engine steps as `python benchmarks/ab_steps.py --switch packed-linear` times them (B requests
with chat-like mixed contexts, packing toggled between pairs of steps in the same process).
`--matmuls` also times the model's single products (rows x in -> out) the same way, the packed path on
the packed weight against `F.linear` on the plain one, at `--matmul-rows` (default: the batch sizes).

    python benchmarks/packed_linear.py --batch-sizes 1 8 32 64 --repeats 10 --matmuls
    python benchmarks/packed_linear.py --batch-sizes 8 --matmuls --matmul-rows 64 512 2048   # prefill sizes
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from ab_steps import CHAT_CONTEXTS, SWITCHES, _dense_copies, ab_steps, time_pairs

from conveyor import LLM
from conveyor.model.kernels import panel_gemm
from conveyor.model.linear import packed_product, pack_weight


def row(label: str, times: dict[str, list[float]], flops: float) -> str:
    packed, plain = statistics.median(times["packed"]), statistics.median(times["plain"])
    return (f"| {label} | {min(times['packed']):.2f} / {packed:.2f} | {min(times['plain']):.2f} / {plain:.2f}"
            f" | {plain / packed:.2f}x | {flops / packed / 1e6:.0f} / {flops / plain / 1e6:.0f} |")


def matmuls(llm: LLM, rows: list[int], repeats: int) -> None:
    model = llm.engine.runner.model
    layer = model.layers[0]
    modules = {"qkv": layer.qkv, "o_proj": layer.o_proj, "gate_up": layer.gate_up, "down": layer.down, "lm_head": model.head}
    dense = _dense_copies(model)  # weights are held once, packed: their fp32 values, as plain tensors
    shapes = {name: m.weight if m.weight is not None else dense[id(m.packed)] for name, m in modules.items()}
    print("\n| product (rows x in -> out) | packed ms (min / median) | plain ms (min / median) | plain / packed "
          "| GFLOP/s packed / plain |")
    print("|---|---:|---:|---:|---:|")
    for batch in rows:
        for name, weight in shapes.items():
            packed = pack_weight(weight)
            x = torch.randn(batch, weight.shape[1])
            runs = {"packed": lambda x=x, packed=packed: packed_product(x, packed, None, panel_gemm()),
                    "plain": lambda x=x, weight=weight: F.linear(x, weight)}
            label = f"{name} {batch} x {weight.shape[1]} -> {weight.shape[0]}"
            print(row(label, time_pairs(runs, repeats * 3), 2.0 * x.numel() * weight.shape[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=CHAT_CONTEXTS)
    parser.add_argument("--repeats", type=int, default=10, help="pairs of steps timed per mode")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--matmuls", action="store_true", help="also time the single products")
    parser.add_argument("--matmul-rows", type=int, nargs="+", default=None, help="rows of the single products")
    args = parser.parse_args()

    llm = LLM(None, max_num_seqs=max(args.batch_sizes), num_threads=args.num_threads)
    ab_steps(llm.engine, SWITCHES["packed-linear"](), args.batch_sizes, args.contexts, args.repeats, ("packed", "plain"))
    if args.matmuls:
        matmuls(llm, args.matmul_rows or args.batch_sizes, args.repeats)


if __name__ == "__main__":
    main()
