"""Why continuous batching's gain over static batching stops short of 2x on this CPU: a two-cost
model fitted to one `conveyor bench compare` run of both policies.

A run's duration is ~ steps x W + tokens x c: W is what a step costs whatever its batch (the weight
stream, Python, the step's fixed work), c what each token adds (its share of the matmul FLOPs,
attention over its context, prefill). Both policies compute the same tokens; they differ in how
many steps they take. Two runs give two equations, so W and c; the model then predicts the ratio at
other max_num_seqs from the workload's output lengths alone (FCFS batches for static, the
least-loaded slot for continuous) and says how small c / W must be for 2x.

    python benchmarks/seed_cost_model.py out/compare-seed-256-m8/compare.json
"""
from __future__ import annotations

import argparse
import heapq
import json


def static_steps(outputs: list[int], slots: int) -> int:
    return sum(max(outputs[i:i + slots]) for i in range(0, len(outputs), slots))


def continuous_steps(outputs: list[int], slots: int) -> int:
    ends = [0] * slots
    for n in outputs:
        heapq.heappush(ends, heapq.heappop(ends) + n)
    return max(ends)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("compare_json", help="compare.json of a run with the static and continuous policies")
    parser.add_argument("--slots", type=int, nargs="+", default=[2, 4, 6, 8, 12, 16, 32])
    args = parser.parse_args()
    runs = {r["policy"]: r for r in json.load(open(args.compare_json))["runs"]}
    static, continuous = runs["static"], runs["continuous"]
    outputs = static["output_lens"]
    tokens = static["total_output_tokens"]
    (s1, d1), (s2, d2) = [(len(r["trace"]["t"]), r["duration"]) for r in (static, continuous)]
    per_step = (d1 - d2) / (s1 - s2)
    per_token = (d1 - s1 * per_step) / tokens
    measured = d1 / d2
    print(f"static {s1} steps in {d1:.0f} s, continuous {s2} steps in {d2:.0f} s: continuous {measured:.2f}x")
    print(f"fit: W = {per_step * 1e3:.1f} ms a step, c = {per_token * 1e3:.2f} ms a token (c / W = {per_token / per_step:.3f})")
    print("max_num_seqs | static steps | continuous steps | steps saved | predicted continuous / static | c / W for 2x")
    for slots in args.slots:
        ss, cs = static_steps(outputs, slots), continuous_steps(outputs, slots)
        predicted = (ss * per_step + tokens * per_token) / (cs * per_step + tokens * per_token)
        # (ss W + T c) / (cs W + T c) >= 2  <=>  c / W <= (ss - 2 cs) / T
        needed = (ss - 2 * cs) / tokens
        print(f"{slots:12d} | {ss:12d} | {cs:16d} | {ss / cs:10.2f}x | {predicted:29.2f}x | "
              f"{'unreachable' if needed <= 0 else f'<= {needed:.3f}'}")


if __name__ == "__main__":
    main()
