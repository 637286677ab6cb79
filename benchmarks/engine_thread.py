"""Engine steps on the thread that loaded the model vs on a second thread (libgomp's teams).

libgomp keeps one team of worker threads per thread that starts parallel regions. When the model
is loaded on one thread and stepped on another (what `conveyor serve` did before
`AsyncEngine.build`), the process holds two teams, more threads than a 2-core machine has cores,
and libgomp then stops spinning at barriers: every parallel region waits for a sleeping worker.
Each mode runs in a fresh process (a team, once made, lives as long as its thread):

- `main`: load and step on the main thread (offline `LLM`);
- `second-thread`: load on the main thread, step on another (the old server);
- `one-thread`: load and step on one non-main thread (the server with `AsyncEngine.build`).

    python benchmarks/engine_thread.py --rounds 2
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

from conveyor import LLM, SamplingParams

MODES = ("main", "second-thread", "one-thread")


def uniform_run(llm: LLM, salt: int, num: int = 32, input_len: int = 100, output_len: int = 200) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(num):
        engine.add_request([(salt * 7919 + 31 * j + 97 * i) % 30000 + 100 for j in range(input_len)], params)
    start = time.perf_counter()
    while engine.has_unfinished_requests:
        engine.step()
    return num * output_len / (time.perf_counter() - start)


def measure(mode: str) -> float:
    result: list[float] = []

    def load() -> LLM:
        return LLM(None, max_num_seqs=32)

    def step(llm: LLM) -> None:
        uniform_run(llm, 0, num=8, output_len=16)  # warm-up
        result.append(uniform_run(llm, 1))

    if mode == "main":
        step(load())
    elif mode == "second-thread":
        llm = load()
        thread = threading.Thread(target=step, args=(llm,))
        thread.start()
        thread.join()
    else:
        thread = threading.Thread(target=lambda: step(load()))
        thread.start()
        thread.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one measurement, in this process
    args = parser.parse_args()
    if args.mode:
        print(f"{measure(args.mode):.1f}")
        return
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--mode", mode], capture_output=True, text=True, check=True)
            results[mode].append(float(out.stdout.strip().splitlines()[-1]))
    print("32 requests, 100-token prompts, 200 output tokens each, all at once; output tok/s per round")
    print("| mode | tok/s | x second-thread (median) |")
    print("|---|---|---:|")
    base = statistics.median(results["second-thread"])
    for mode, values in results.items():
        print(f"| {mode} | {' / '.join(f'{v:.1f}' for v in values)} | {statistics.median(values) / base:.2f}x |")


if __name__ == "__main__":
    main()
