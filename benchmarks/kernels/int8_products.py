"""The int8-activation products of a real model's forward pass (quant_int8.cpp), this tree's kernel
against its source at `--baseline REV`, on the model's own activations.

Captures the input of every product on GGUF blocks while the model reads 512 tokens of the
standard library's source (`conveyor bench quality`'s code text), then times both builds on the
same inputs at each row count (the first rows of each input), alternating the builds product by
product so that the machine's drift hits both alike. Prints min / median milliseconds per pass over
all the products and the ratio of medians (baseline / this tree); checks nothing but that both ran.
The activations matter: the kernel's cost depends on how many of a row's features it carries
exactly (docs/PERF.md, "Lone large features, carried exactly").
At a few rows, where a pass is bound by reading the weights, one build's run of a product finds
the weights in the L3 the other's just filled, which hides differences there: compare whole decode
steps with benchmarks/ab_steps.py --switch int8-kernel-at instead.

    python benchmarks/kernels/int8_products.py --model qwen2.5-coder-0.5b --baseline HEAD~1 --rows 1 8 16 32 512
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from conveyor.bench.quality import EXACT, FLOAT16, code_text, score
from conveyor.config import EngineConfig
from conveyor.model import kernels, linear
from conveyor.model.linear import PackedWeight
from conveyor.model.quantized import KERNEL_QTYPE
from conveyor.runner.model_runner import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_at import kernel_at  # noqa: E402

CAPTURED_TOKENS = 512


def leaves(packed: PackedWeight) -> list[PackedWeight]:
    return [leaf for part in packed.parts for leaf in leaves(part)] if packed.layout == "parts" else [packed]


def capture(model_name: str | None) -> list[tuple[np.ndarray, PackedWeight]]:
    """(x, weight) of each product on blocks in one int8 forward pass over CAPTURED_TOKENS tokens."""
    loaded = load_model(EngineConfig(model=model_name))
    calls: list[tuple[np.ndarray, PackedWeight]] = []
    original = linear.Linear.forward

    def recording(self: linear.Linear, x: np.ndarray, matmul: object = None) -> np.ndarray:
        if loaded.model.activation_dtype == "int8" and self.packed is not None and x.ndim == 2:
            calls.extend((np.array(x, order="C"), leaf) for leaf in leaves(self.packed) if leaf.layout in KERNEL_QTYPE)
        return original(self, x, matmul)  # type: ignore[arg-type]

    linear.Linear.forward = recording  # type: ignore[method-assign]
    try:
        ids = loaded.tokenizer.encode(code_text())[: CAPTURED_TOKENS + 1]
        score(loaded.model, ids, CAPTURED_TOKENS, (EXACT, ("int8", FLOAT16)))
    finally:
        linear.Linear.forward = original  # type: ignore[method-assign]
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="smollm2-135m (default), gemma3-270m, qwen2.5-coder-0.5b, a .gguf")
    parser.add_argument("--baseline", default="HEAD", help="git revision of quant_int8.cpp to compare with")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 512])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    builds = {"this tree": kernels.quant_int8(), args.baseline: kernel_at(args.baseline, "quant_int8")}
    if builds["this tree"] is None:
        raise SystemExit("the int8 kernel does not build here")
    calls = capture(args.model)
    print(f"{args.model or 'smollm2-135m'}: {len(calls)} products a pass; ms per pass, min / median")
    print(f"| rows | this tree | {args.baseline} | {args.baseline} / this tree |")
    print("|---:|---:|---:|---:|")
    labels = list(builds)
    for rows in args.rows:
        inputs = [(x[:rows], packed) for x, packed in calls if x.shape[0] >= rows]
        times: dict[str, list[float]] = {label: [] for label in labels}
        for repeat in range(args.repeats):
            spent = dict.fromkeys(labels, 0.0)
            for x, packed in inputs:
                for label in labels[repeat % 2:] + labels[: repeat % 2]:
                    start = time.perf_counter()
                    builds[label].int8_matmul(x, packed.data, packed.out_features, None,  # type: ignore[union-attr]
                                              KERNEL_QTYPE[packed.layout])
                    spent[label] += time.perf_counter() - start
            for label in labels:
                times[label].append(spent[label] * 1e3)
        new, old = times[labels[0]], times[labels[1]]
        print(f"| {rows} | {min(new):.1f} / {statistics.median(new):.1f} | {min(old):.1f} / {statistics.median(old):.1f} "
              f"| {statistics.median(old) / statistics.median(new):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
