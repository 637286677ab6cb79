"""Greedy decoding's vocabulary projection: the full fp32 product on the head's blocks then argmax,
against the int8-screened argmax (conveyor.model.linear.screened_argmax: quant_gemm.cpp's
q8_0_argmax for a Q8_0 head on AVX-512 VNNI/VBMI builds, else the int8 kernel's product bounded by
the head's column norms, any type it reads, AVX2 too), on a real model's head and real final
hidden states.

Loads the model, runs a few greedy prompts to collect the hidden states the head takes, checks
that both give the same index for every row, prints how many columns each row had to compute
exactly (the smallest candidate cap at which the screen does not give up), then times both at each
row count, alternated repeat by repeat, min / median.

    python benchmarks/kernels/screened_argmax.py --model gemma3-270m --rows 1 8 32
    python benchmarks/kernels/screened_argmax.py --rows 1 8 32       # the default SmolLM2-135M
    python benchmarks/kernels/screened_argmax.py --model qwen2.5-coder-0.5b --rows 1 8 32
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np

from conveyor import LLM, SamplingParams
from conveyor.model.kernels import quant_gemm
from conveyor.model.linear import screen_candidates, screened_argmax
from conveyor.model.quantized import KERNEL_QTYPE

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3, 4,", "The three laws of thermodynamics are", "SELECT name FROM users WHERE"]


def final_hidden_states(llm: LLM, tokens: int) -> np.ndarray:
    model = llm.engine.runner.model
    seen: list[np.ndarray] = []
    plain = model.sampling_hidden

    def keep(*args: object, **kwargs: object) -> np.ndarray:
        h = plain(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(h.copy())
        return h

    model.sampling_hidden = keep  # type: ignore[method-assign]
    try:
        llm.generate(PROMPTS, SamplingParams(max_tokens=tokens, temperature=0.0))
    finally:
        model.sampling_hidden = plain  # type: ignore[method-assign]
    return np.concatenate(seen)


def candidates_needed(screen: Callable, h: np.ndarray, data: np.ndarray, out_features: int) -> int:
    low, high = 1, out_features
    while low < high:
        mid = (low + high) // 2
        if int(screen(h, data, out_features, mid)[0]) >= 0:
            high = mid
        else:
            low = mid + 1
    return low


def kernel_isa() -> str:
    from conveyor.model.kernels import quant_int8

    module = quant_int8()
    return "none" if module is None else str(module.isa())  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="smollm2-135m (default), gemma3-270m, qwen2.5-coder-0.5b, a .gguf file")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt whose hidden states are kept")
    args = parser.parse_args()
    kernel = quant_gemm()
    llm = LLM(args.model, num_kv_blocks=256)
    model = llm.engine.runner.model
    packed, norms = model.head.packed, model.head_norms
    if packed is None or packed.layout not in KERNEL_QTYPE:
        raise SystemExit(f"the head is not in GGUF blocks here ({None if packed is None else packed.layout})")
    in_kernel = getattr(kernel, "q8_0_argmax", None) if packed.layout == "Q8_0" else None
    if in_kernel is None and norms is None:
        raise SystemExit(f"no screened argmax for a {packed.layout} head in this build")
    hidden = final_hidden_states(llm, args.tokens)
    qtype = KERNEL_QTYPE[packed.layout]

    def full(x: np.ndarray) -> np.ndarray:
        return kernel.quantized_matmul(x, packed.data, packed.out_features, None, qtype).argmax(axis=-1)  # type: ignore[union-attr]

    def screened(x: np.ndarray) -> np.ndarray:
        tokens = screened_argmax(x, packed, norms)
        assert tokens is not None
        return tokens

    same = np.array_equal(full(hidden), screened(hidden))
    if in_kernel is not None:
        route = "q8_0_argmax"
        counts = sorted(candidates_needed(in_kernel, hidden[i : i + 1], packed.data, packed.out_features)
                        for i in range(hidden.shape[0]))
    else:
        assert norms is not None
        product = "bf16 product (AVX512-BF16)" if packed.layout == "BF16" else f"int8 product ({kernel_isa()})"
        route = f"{product} and column norms"
        counts = sorted(int(c) for c in screen_candidates(hidden, packed, norms)[0].sum(axis=-1))
    print(f"head: {packed.out_features} x {hidden.shape[1]} {packed.layout} ({packed.nbytes / 1e6:.0f} MB), screened by "
          f"{route}; {hidden.shape[0]} real hidden states; same argmax for every row: {same}")
    print(f"columns computed exactly per row: min {counts[0]}, median {counts[len(counts) // 2]}, "
          f"max {counts[-1]} (of {packed.out_features}; whole panels of 16 around them)")
    print("| rows | full product + argmax ms (min / median) | screened ms (min / median) | full / screened |")
    print("|---:|---:|---:|---:|")
    for rows in args.rows:
        x = np.ascontiguousarray(hidden[np.arange(rows) % hidden.shape[0]])
        times: dict[str, list[float]] = {"full": [], "screened": []}
        for _ in range(2):
            full(x), screened(x)
        for _ in range(args.repeats):
            for name, fn in (("full", full), ("screened", screened)):
                start = time.perf_counter()
                fn(x)
                times[name].append((time.perf_counter() - start) * 1e3)
        a, b = times["full"], times["screened"]
        print(f"| {rows} | {min(a):.2f} / {statistics.median(a):.2f} | {min(b):.2f} / {statistics.median(b):.2f} | "
              f"{statistics.median(a) / statistics.median(b):.2f}x |")


if __name__ == "__main__":
    main()
