"""A long prompt's chunked prefill with a step's layers in runs of memory.LAYER_ROWS rows against all
of a step's rows at once, alternated in one process. Each run's prefill attention copies every key
its queries can see out of the cache again, so a chunk after a long cached context copies that
context once a run: this measures what that costs where it is largest, the last chunks of a prompt
near the model's context.

    .venv/bin/python benchmarks/layer_rows_long_context.py --model gemma3-270m --tokens 16384
    .venv/bin/python benchmarks/layer_rows_long_context.py --model smollm2-135m --tokens 8000

Each repeat prefills a fresh prompt of TOKENS distinct tokens (prefix caching off, the default step
budget cuts it into chunks) and samples one token, once per side, the order alternating; prints each
prompt's total time and its last chunk's step, then the medians.
"""
from __future__ import annotations

import argparse
import statistics
import time

from conveyor.bench.decode import decode_prompt
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.model import memory
from conveyor.runner.model_runner import load_model
from conveyor.sampling.params import SamplingParams

ALL_ROWS = 1 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    loaded = load_model(EngineConfig(model=args.model))
    engine = LLMEngine.from_config(EngineConfig.from_kwargs(model=args.model, enable_prefix_caching=False,
                                                            num_kv_blocks=args.tokens // 16 + 64, max_num_seqs=4),
                                   loaded)
    runs = memory.LAYER_ROWS
    totals: dict[int, list[float]] = {runs: [], ALL_ROWS: []}
    lasts: dict[int, list[float]] = {runs: [], ALL_ROWS: []}
    for repeat in range(args.repeats):
        for side, rows in enumerate((runs, ALL_ROWS) if repeat % 2 == 0 else (ALL_ROWS, runs)):
            memory.LAYER_ROWS = rows
            engine.add_request(decode_prompt(90_000 + 2 * repeat + side, args.tokens),
                               SamplingParams(max_tokens=1, temperature=0))
            steps = []
            while engine.has_unfinished_requests:
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            totals[rows].append(sum(steps))
            lasts[rows].append(steps[-1])
            label = f"runs of {runs}" if rows == runs else "all rows"
            print(f"{label:>12}: {sum(steps):6.2f} s, last chunk {steps[-1] * 1e3:6.0f} ms ({len(steps)} steps)", flush=True)
    memory.LAYER_ROWS = runs
    total_ratio = statistics.median(totals[ALL_ROWS]) / statistics.median(totals[runs])
    last_ratio = statistics.median(lasts[ALL_ROWS]) / statistics.median(lasts[runs])
    print(f"{args.model}, {args.tokens} tokens: all rows / runs of {runs}, medians of {args.repeats}: "
          f"whole prompt {total_ratio:.2f}x, last chunk {last_ratio:.2f}x")


if __name__ == "__main__":
    main()
