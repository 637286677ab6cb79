"""Engine decode steps with the C++ paged decode kernel vs the torch fallback (gather + padded SDPA).

B requests with mixed context lengths (drawn from `--contexts`, chat-like: most short, a few long,
so the fallback pads every row to the longest) decode together; whole engine steps are timed with
CONVEYOR_KERNELS toggled between pairs of steps in the same process, so drift hits both alike.

    python benchmarks/decode_kernel.py --batch-sizes 8 32 64 --repeats 10
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from conveyor import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[124, 140, 160, 185, 185, 200, 250, 300, 519])
    parser.add_argument("--repeats", type=int, default=10, help="pairs of steps timed per mode")
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()

    llm = LLM(None, max_num_seqs=max(args.batch_sizes), num_threads=args.num_threads)
    engine = llm.engine
    rng = random.Random(0)
    print("| batch | contexts (mean / max) | kernel step ms (min / median) | fallback step ms (min / median) | fallback / kernel |")
    print("|---:|---:|---:|---:|---:|")
    for batch in args.batch_sizes:
        lens = [rng.choice(args.contexts) for _ in range(batch)]
        ids = []
        for i, context in enumerate(lens):
            prompt = [(7 * i + 13 * j) % 30000 + 100 for j in range(context)]
            params = SamplingParams(max_tokens=4 * args.repeats + 8, temperature=0.0, ignore_eos=True)
            ids.append(engine.add_request(prompt, params))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
            engine.step()
        times: dict[str, list[float]] = {"1": [], "0": []}
        for _ in range(args.repeats):
            for mode in ("1", "0"):
                os.environ["CONVEYOR_KERNELS"] = mode
                start = time.perf_counter()
                engine.step()
                engine.step()
                times[mode].append((time.perf_counter() - start) / 2 * 1e3)
        os.environ.pop("CONVEYOR_KERNELS")
        for request_id in ids:
            engine.abort_request(request_id)
        kernel, fallback = times["1"], times["0"]
        print(f"| {batch} | {statistics.mean(lens):.0f} / {max(lens)} | {min(kernel):.1f} / {statistics.median(kernel):.1f} "
              f"| {min(fallback):.1f} / {statistics.median(fallback):.1f} "
              f"| {statistics.median(fallback) / statistics.median(kernel):.2f}x |")


if __name__ == "__main__":
    main()
