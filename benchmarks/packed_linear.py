"""Engine decode steps with oneDNN pre-packed fp32 weights vs plain `F.linear` (MKL on the plain weight).

B requests with chat-like mixed contexts decode together; whole engine steps are timed with
CONVEYOR_PACKED_LINEAR toggled between pairs of steps in the same process, so drift hits both alike.
`--matmuls` also times the model's single products (rows x in -> out) the same way.

    python benchmarks/packed_linear.py --batch-sizes 1 8 32 64 --repeats 10 --matmuls
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Callable

import torch

from conveyor import LLM, SamplingParams
from conveyor.model.linear import linear, pack_weight

MODES = {"packed": "1", "plain": "0"}


def time_pairs(run: Callable[[], None], repeats: int) -> dict[str, list[float]]:
    """Milliseconds per call of `run` in each mode, alternating modes every pair of calls."""
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode, flag in MODES.items():
            os.environ["CONVEYOR_PACKED_LINEAR"] = flag
            start = time.perf_counter()
            run()
            run()
            times[mode].append((time.perf_counter() - start) / 2 * 1e3)
    os.environ.pop("CONVEYOR_PACKED_LINEAR")
    return times


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
        print(row(str(batch), time_pairs(engine.step, repeats)))
        for request_id in ids:
            engine.abort_request(request_id)


def matmuls(llm: LLM, batch_sizes: list[int], repeats: int) -> None:
    model = llm.engine.runner.model
    layer = model.layers[0]
    shapes = {"qkv": layer.qkv.weight, "o_proj": layer.o_proj.weight, "gate_up": layer.gate_up.weight,
              "down": layer.down.weight, "lm_head": model.head_weight}
    print("\n| product (rows x in -> out) | packed ms (min / median) | plain ms (min / median) | plain / packed | GFLOP/s packed / plain |")
    print("|---|---:|---:|---:|---:|")
    for batch in batch_sizes:
        for name, weight in shapes.items():
            packed = pack_weight(weight)
            x = torch.randn(batch, weight.shape[1])
            label = f"{name} {batch} x {weight.shape[1]} -> {weight.shape[0]}"
            print(row(label, time_pairs(lambda: linear(x, weight, packed), repeats * 3), 2.0 * x.numel() * weight.shape[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[124, 140, 160, 185, 185, 200, 250, 300, 519])
    parser.add_argument("--repeats", type=int, default=10, help="pairs of steps timed per mode")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--matmuls", action="store_true", help="also time the single products")
    args = parser.parse_args()

    llm = LLM(None, max_num_seqs=max(args.batch_sizes), num_threads=args.num_threads)
    engine_steps(llm, args.batch_sizes, args.contexts, args.repeats)
    if args.matmuls:
        matmuls(llm, args.batch_sizes, args.repeats)


if __name__ == "__main__":
    main()
