"""The sampler alone: median time of one Sampler call on random fp32 logits [rows, vocab], for the
settings clients send, with nothing of the model around it. Two revisions' samplers are compared in
one run: each measured in a subprocess of its own (its worktree on PYTHONPATH), alternately, round
after round; the table gives each setting's median over rounds and their ratio.

    python benchmarks/sampler_alone.py --compare /work/main /work/tf-sampling --rows 1 16 --rounds 3

The logits: `flat` is randn x 3 (a top-p 0.95 nucleus of ~13,000 tokens, as random prompts give),
`peaked` is randn x 2 with ten tokens 15 higher (a nucleus of a few tokens, as a chat model's
next token usually is). Each sampler gets the runner's argmax (the fused kernel), except "greedy,
own argmax", which takes each sampler's default. On a machine other processes also load, the
kernels' threads wait at barriers for a core (several ms a call): `--threads 1` measures the two on
one core each. A revision whose kernels take numpy arrays runs with no torch at all; one from
before that port (torch-bound kernels, `layer_ops(dtype)`) imports torch, and the argmax kernel
is handed a tensor sharing the logits (torch.from_numpy) where its sampler takes numpy arrays,
the sampler itself a tensor where it takes torch tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

CHAIN = ("top_k", "top_p", "min_p", "temperature")  # llama.cpp's order
SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0),
    "greedy, own argmax": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "top_k 40 + top_p 0.95": dict(temperature=0.8, top_k=40, top_p=0.95),
    "llama.cpp chain (top_k 40, top_p 0.95, min_p 0.05)": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                                                                sampler_chain=CHAIN),
    "llama.cpp chain, top_k 0": dict(temperature=0.8, top_p=0.95, min_p=0.05, sampler_chain=CHAIN),
    "seeded, temperature 0.8": dict(temperature=0.8, seed=0),
    "logprobs 5, temperature 0.8": dict(temperature=0.8, logprobs=5),
    "repetition_penalty 1.1, 500 prior tokens": dict(temperature=0.8, repetition_penalty=1.1),
}
VOCAB = 151_936


def logits_of(kind: str, rows: int) -> np.ndarray:
    rng = np.random.default_rng(rows)
    if kind == "flat":
        return (rng.standard_normal((rows, VOCAB)) * 3).astype(np.float32)
    x = rng.standard_normal((rows, VOCAB)) * 2
    for row in x:
        row[rng.choice(VOCAB, 10, replace=False)] += 15.0
    return x.astype(np.float32)


def child(args: argparse.Namespace) -> None:
    """Times this revision's sampler; prints {setting: {kind: {rows: median seconds}}} as JSON."""
    import inspect

    from conveyor.model.kernels import build_kernels
    from conveyor.model.ops import layer_ops
    from conveyor.request import Request
    from conveyor.sampling.params import SamplingParams
    from conveyor.sampling.sampler import Sampler

    from conveyor.model.memory import reuse_freed_memory

    reuse_freed_memory(1 << 29)  # as a serving process: a step's freed memory is kept for the next
    takes_numpy = "torch" not in Sampler.__call__.__annotations__.get("logits", "torch")
    given_as: Callable[[np.ndarray], Any] = np.asarray  # the logits as this revision's sampler takes them (no copy)
    if inspect.signature(layer_ops).parameters:  # a revision before the numpy port: torch-bound kernels
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        build_kernels(torch.float32)
        kernel = layer_ops(torch.float32).argmax_rows
        argmax = (lambda a: kernel(torch.from_numpy(a)).numpy()) if takes_numpy else kernel
        if not takes_numpy:
            given_as = torch.from_numpy
    else:  # numpy-bound kernels: no torch in this process
        if args.threads:
            from conveyor.model.threads import set_num_threads

            set_num_threads(args.threads)
        build_kernels()
        argmax = layer_ops().argmax_rows
    rng = np.random.default_rng(0)
    prior = rng.integers(0, VOCAB, 500).tolist()
    results: dict[str, dict[str, dict[int, float]]] = {}
    for name, setting in SETTINGS.items():
        results[name] = {}
        for kind in args.kinds:
            results[name][kind] = {}
            for rows in args.rows:
                logits = logits_of(kind, rows)
                given = given_as(logits)
                requests = []
                for i in range(rows):
                    params = dict(setting, seed=i) if "seed" in setting else setting
                    request = Request(str(i), prior[:400], SamplingParams(max_tokens=4096, **params), 0.0)
                    request.output_token_ids = list(prior[400:])
                    requests.append(request)
                sampler = Sampler() if name == "greedy, own argmax" else Sampler(argmax=argmax)
                calls = args.calls if rows == 1 else max(5, args.calls // 3)
                for _ in range(2):
                    sampler(given, requests)
                times = []
                for _ in range(calls):
                    start = time.perf_counter()
                    sampler(given, requests)
                    times.append(time.perf_counter() - start)
                results[name][kind][rows] = statistics.median(times)
    print(json.dumps(results))


def compare(args: argparse.Namespace) -> None:
    a, b = args.compare
    runs: dict[str, list[dict[str, Any]]] = {a: [], b: []}
    for round_ in range(args.rounds):
        for path in (a, b) if round_ % 2 == 0 else (b, a):
            command = [sys.executable, __file__, "--child", "--rows", *map(str, args.rows), "--kinds", *args.kinds,
                       "--calls", str(args.calls), "--threads", str(args.threads)]
            done = subprocess.run(command, env={**os.environ, "PYTHONPATH": path}, check=True, capture_output=True,
                                  text=True)
            runs[path].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {round_ + 1}: {path} done", file=sys.stderr)
    print(f"median ms per call over {args.rounds} rounds (each the median of its calls); "
          f"A = {a}, B = {b}; B / A; kernel threads: {args.threads or 'the default'}")
    print("| setting | logits | " + " | ".join(f"{r} row{'s' if r > 1 else ''}: A, B, B/A" for r in args.rows) + " |")
    print("|---|---|" + "---|" * len(args.rows))
    for name in SETTINGS:
        for kind in args.kinds:
            cells = []
            for rows in args.rows:
                ma = statistics.median(run[name][kind][str(rows)] for run in runs[a]) * 1e3
                mb = statistics.median(run[name][kind][str(rows)] for run in runs[b]) * 1e3
                cells.append(f"{ma:.3f}, {mb:.3f}, **{mb / ma:.2f}x**")
            print(f"| {name} | {kind} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two worktrees to compare")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--kinds", nargs="+", default=["peaked", "flat"], choices=["peaked", "flat"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=30, help="timed calls per setting at 1 row (a third at more rows)")
    p.add_argument("--threads", type=int, default=0, help="the kernels' threads (0: the default, one a core); "
                   "numpy runs the sampler on one")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
    elif args.compare:
        compare(args)
    else:
        p.error("--compare A B")


if __name__ == "__main__":
    main()
