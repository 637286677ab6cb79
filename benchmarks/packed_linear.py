"""Engine decode steps with oneDNN pre-packed fp32 weights vs plain `F.linear` (MKL on the plain weight).

B requests with chat-like mixed contexts decode together; whole engine steps are timed with
CONVEYOR_PACKED_LINEAR toggled between pairs of steps in the same process, so drift hits both alike.
`--matmuls` also times the model's single products (rows x in -> out) the same way, oneDNN on
the packed weight against `F.linear` on the plain one, at `--matmul-rows` (default: the batch sizes).

    python benchmarks/packed_linear.py --batch-sizes 1 8 32 64 --repeats 10 --matmuls
    python benchmarks/packed_linear.py --batch-sizes 8 --matmuls --matmul-rows 64 512 2048   # prefill sizes
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from conveyor import LLM, SamplingParams
from conveyor.model.linear import packed_product, pack_weight


def time_pairs(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Milliseconds per call of each mode's callable, alternating modes every pair of calls."""
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    for _ in range(repeats):
        for mode, run in runs.items():
            start = time.perf_counter()
            run()
            run()
            times[mode].append((time.perf_counter() - start) / 2 * 1e3)
    return times


def step_with_packing(engine, flag: str) -> Callable[[], object]:
    def step() -> object:
        os.environ["CONVEYOR_PACKED_LINEAR"] = flag
        return engine.step()
    return step


def row(label: str, times: dict[str, list[float]], flops: float | None = None) -> str:
    packed, plain = statistics.median(times["packed"]), statistics.median(times["plain"])
    rate = f" | {flops / packed / 1e6:.0f} / {flops / plain / 1e6:.0f}" if flops else ""
    return (f"| {label} | {min(times['packed']):.2f} / {packed:.2f} | {min(times['plain']):.2f} / {plain:.2f}"
            f" | {plain / packed:.2f}x{rate} |")


def engine_steps(llm: LLM, batch_sizes: list[int], contexts: list[int], repeats: int) -> None:
    engine = llm.engine
    rng = random.Random(0)
    print("| batch | packed step ms (min / median) | plain step ms (min / median) | plain / packed |")
    print("|---:|---:|---:|---:|")
    for batch in batch_sizes:
        ids = []
        for i in range(batch):
            prompt = [(7 * i + 13 * j) % 30000 + 100 for j in range(rng.choice(contexts))]
            params = SamplingParams(max_tokens=4 * repeats + 8, temperature=0.0, ignore_eos=True)
            ids.append(engine.add_request(prompt, params))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
            engine.step()
        runs = {"packed": step_with_packing(engine, "1"), "plain": step_with_packing(engine, "0")}
        print(row(str(batch), time_pairs(runs, repeats)))
        os.environ.pop("CONVEYOR_PACKED_LINEAR")
        for request_id in ids:
            engine.abort_request(request_id)


def matmuls(llm: LLM, rows: list[int], repeats: int) -> None:
    model = llm.engine.runner.model
    layer = model.layers[0]
    shapes = {"qkv": layer.qkv.weight, "o_proj": layer.o_proj.weight, "gate_up": layer.gate_up.weight,
              "down": layer.down.weight, "lm_head": model.head_weight}
    print("\n| product (rows x in -> out) | packed ms (min / median) | plain ms (min / median) | plain / packed | GFLOP/s packed / plain |")
    print("|---|---:|---:|---:|---:|")
    for batch in rows:
        for name, weight in shapes.items():
            packed = pack_weight(weight)
            x = torch.randn(batch, weight.shape[1])
            runs = {"packed": lambda: packed_product(x, packed, None), "plain": lambda: F.linear(x, weight)}
            label = f"{name} {batch} x {weight.shape[1]} -> {weight.shape[0]}"
            print(row(label, time_pairs(runs, repeats * 3), 2.0 * x.numel() * weight.shape[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[124, 140, 160, 185, 185, 200, 250, 300, 519])
    parser.add_argument("--repeats", type=int, default=10, help="pairs of steps timed per mode")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--matmuls", action="store_true", help="also time the single products")
    parser.add_argument("--matmul-rows", type=int, nargs="+", default=None, help="rows of the single products")
    args = parser.parse_args()

    llm = LLM(None, max_num_seqs=max(args.batch_sizes), num_threads=args.num_threads)
    engine_steps(llm, args.batch_sizes, args.contexts, args.repeats)
    if args.matmuls:
        matmuls(llm, args.matmul_rows or args.batch_sizes, args.repeats)


if __name__ == "__main__":
    main()
