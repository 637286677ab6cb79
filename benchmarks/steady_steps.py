"""Steady decode steps of the whole engine: B requests with the given prompt lengths decode together
and every step is timed (min / median). For A/B across commits, point PYTHONPATH at a worktree
of the other commit (it comes before the editable install) and alternate:

    git worktree add /tmp/conveyor-before d0edcf0
    for tree in /tmp/conveyor-before "$PWD" /tmp/conveyor-before "$PWD"; do
        PYTHONPATH=$tree .venv/bin/python benchmarks/steady_steps.py --batch 1 --contexts 300 --steps 300
    done
"""
from __future__ import annotations

import argparse
import statistics
import time

from ab_steps import start_decode_batch

import conveyor  # printed: which tree ran, for the A/B above
from conveyor import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--contexts", type=int, nargs="+", default=[300], help="prompt lengths drawn per request")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--dequantize-weights", action="store_true", help="dense fp32 matmuls, not the GGUF's blocks")
    args = parser.parse_args()
    llm = LLM(None, max_num_seqs=max(args.batch, 1), num_threads=args.num_threads,
              dequantize_weights=args.dequantize_weights)
    start_decode_batch(llm.engine, args.batch, args.contexts, args.steps + 2)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        llm.engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    weights = "dense fp32" if args.dequantize_weights else "GGUF blocks"
    print(f"{conveyor.__file__.rsplit('/conveyor/', 1)[0]} ({weights}): batch {args.batch}, contexts {args.contexts}: "
          f"step ms min {min(times):.1f} / median {statistics.median(times):.1f} over {args.steps} steps")


if __name__ == "__main__":
    main()
