"""A Ray worker's engine (conveyor/distributed/worker.py) driven in-process, without Ray: eight
200-token prompts decode 120 tokens each on two threads; prints output tokens per second.
For A/B across commits, point PYTHONPATH at a worktree of the other commit and alternate:

    git worktree add /tmp/conveyor-before 9f9a781
    for tree in /tmp/conveyor-before "$PWD" /tmp/conveyor-before "$PWD"; do
        PYTHONPATH=$tree .venv/bin/python benchmarks/worker_threads.py
    done
"""
from __future__ import annotations

import asyncio
import time

import conveyor  # printed: which tree ran, for the A/B above
from conveyor.config import EngineConfig
from conveyor.distributed.worker import EngineWorker
from conveyor.sampling.params import SamplingParams

REQUESTS, PROMPT_LEN, OUTPUT_LEN = 8, 200, 120


async def run(worker: EngineWorker) -> float:
    await worker.start()
    params = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True)
    for i in range(REQUESTS):
        await worker.add(f"r{i}", [(17 * i + j) % 5000 + 10 for j in range(PROMPT_LEN)], params, False)
    start = time.perf_counter()
    seen = finished = 0
    while finished < REQUESTS:
        result = await worker.poll(seen, 1.0)
        seen = result.last_seq
        finished += sum(1 for event in result.events if getattr(event, "finished", False))
    took = time.perf_counter() - start
    await worker.stop()
    return took


def main() -> None:
    worker = EngineWorker("w", "replica", EngineConfig.from_kwargs(num_threads=2, max_num_seqs=REQUESTS))
    took = asyncio.run(run(worker))
    tree = conveyor.__file__.rsplit("/conveyor/", 1)[0]
    print(f"{tree}: {REQUESTS} x {OUTPUT_LEN} tokens in {took:.1f} s, {REQUESTS * OUTPUT_LEN / took:.1f} tok/s")


if __name__ == "__main__":
    main()
