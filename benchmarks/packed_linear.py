"""Engine decode steps on weights packed at load vs numpy's matmul on plain fp32 copies of them.

The packed path is the model's kernels (kernels/panel_gemm.cpp on fp32 panels, quant_gemm.cpp and
quant_int8.cpp on GGUF blocks); the plain path is linear.reference_product, `x @ W.T` in numpy (its
BLAS, OpenBLAS in numpy's wheels), what conveyor multiplies on where no kernel is built.

Whole engine steps as `python benchmarks/ab_steps.py --switch packed-linear` times them (B requests
with chat-like mixed contexts, packing toggled between pairs of steps in the same process).
`--matmuls` also times the model's single products (rows x in -> out) the same way, the panel kernel
on fp32 panels of the weight against numpy's matmul on the plain one, at `--matmul-rows` (default:
the batch sizes).

    python benchmarks/packed_linear.py --batch-sizes 1 8 32 64 --repeats 10 --matmuls
    python benchmarks/packed_linear.py --batch-sizes 8 --matmuls --matmul-rows 64 512 2048   # prefill sizes
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
from ab_steps import CHAT_CONTEXTS, SWITCHES, _dense_copies, ab_steps, time_pairs

from conveyor import LLM
from conveyor.model.kernels import panel_gemm
from conveyor.model.linear import pack_weight, packed_product, reference_product


def row(label: str, times: dict[str, list[float]], flops: float) -> str:
    packed, plain = statistics.median(times["packed"]), statistics.median(times["plain"])
    return (f"| {label} | {min(times['packed']):.2f} / {packed:.2f} | {min(times['plain']):.2f} / {plain:.2f}"
            f" | {plain / packed:.2f}x | {flops / packed / 1e6:.0f} / {flops / plain / 1e6:.0f} |")


def matmuls(llm: LLM, rows: list[int], repeats: int) -> None:
    model = llm.engine.runner.model
    layer = model.layers[0]
    modules = {"qkv": layer.qkv, "o_proj": layer.o_proj, "gate_up": layer.gate_up, "down": layer.down, "lm_head": model.head}
    dense = _dense_copies(model)  # weights are held once, packed: their fp32 values, as plain arrays
    shapes = {name: m.weight if m.weight is not None else dense[id(m.packed)] for name, m in modules.items()}
    print("\n| product (rows x in -> out) | packed ms (min / median) | plain ms (min / median) | plain / packed "
          "| GFLOP/s packed / plain |")
    print("|---|---:|---:|---:|---:|")
    for batch in rows:
        for name, weight in shapes.items():
            packed = pack_weight(weight)
            assert packed is not None  # main() checked the panel kernel builds
            x = np.random.default_rng(batch).standard_normal((batch, weight.shape[1]), dtype=np.float32)
            runs = {"packed": lambda x=x, packed=packed: packed_product(x, packed, None, panel_gemm()),
                    "plain": lambda x=x, weight=weight: reference_product(x, weight)}
            label = f"{name} {batch} x {weight.shape[1]} -> {weight.shape[0]}"
            print(row(label, time_pairs(runs, repeats * 3), 2.0 * x.size * weight.shape[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=CHAT_CONTEXTS)
    parser.add_argument("--repeats", type=int, default=10, help="pairs of steps timed per mode")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--matmuls", action="store_true", help="also time the single products")
    parser.add_argument("--matmul-rows", type=int, nargs="+", default=None, help="rows of the single products")
    args = parser.parse_args()
    if args.matmuls and panel_gemm() is None:
        raise SystemExit("--matmuls: the panel kernel is not available here (no compiler, no AVX2/FMA, or CONVEYOR_KERNELS=0)")

    llm = LLM(None, max_num_seqs=max(args.batch_sizes), num_threads=args.num_threads)
    switch = SWITCHES["packed-linear"](llm.engine.runner)
    ab_steps(llm.engine, switch, args.batch_sizes, args.contexts, args.repeats, ("packed", "plain"))
    if args.matmuls:
        matmuls(llm, args.matmul_rows or args.batch_sizes, args.repeats)


if __name__ == "__main__":
    main()
