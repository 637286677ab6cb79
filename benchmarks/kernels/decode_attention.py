"""The paged decode kernel on its own, cold, against the same kernel at another commit.

Builds 30 layers' worth of fp32 KV caches of SmolLM2-135M's shape (3 KV heads x 64, 9 query heads)
with each request's blocks scattered through the pool, and times one pass of the kernel over all
30 layers for each set of context lengths (one set = one decode batch). `--baseline REV` builds
`conveyor/model/kernels/paged_decode.cpp` as it was at git revision REV under another name and
alternates the two repeat by repeat, so the machine's drift hits both alike; outputs are checked
to agree first.

    python benchmarks/kernels/decode_attention.py --baseline d0edcf0~2 --contexts 1400 1000,1400,600 \\
        1400,1400,1400,300,300,200 1000,1200,1400,600,1000,1200,1400,600
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from kernel_at import kernel_at

from conveyor.model.kernels import paged_decode_kernel

LAYERS, KV_HEADS, HEADS, HEAD_DIM = 30, 3, 9, 64


def decode_batch(contexts: list[int], block_size: int, seed: int = 0):
    """Per-layer caches holding just these requests' blocks, in shuffled order, and their tables."""
    blocks = [-(-c // block_size) for c in contexts]
    pool = sum(blocks) + 8
    caches = [(torch.randn(pool, block_size, KV_HEADS, HEAD_DIM), torch.randn(pool, block_size, KV_HEADS, HEAD_DIM))
              for _ in range(LAYERS)]
    order = list(range(pool))
    random.Random(seed).shuffle(order)
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.long)
    taken = 0
    for row, n in enumerate(blocks):
        tables[row, :n] = torch.tensor(order[taken:taken + n])
        taken += n
    return caches, tables, torch.tensor(contexts, dtype=torch.long)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", nargs="+", required=True, help="comma-separated context lengths, one batch each")
    parser.add_argument("--baseline", help="git revision whose kernel to time beside the working tree's")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    current = paged_decode_kernel()
    if current is None:
        raise SystemExit("the decode kernel is not available here (no compiler, or CONVEYOR_KERNELS=0)")
    kernels = {"this tree": current}
    if args.baseline:
        kernels[args.baseline] = kernel_at(args.baseline, "paged_decode").paged_decode_attention  # type: ignore[attr-defined]
    names = list(kernels)
    header = " | ".join(f"{name} ms (min / median) | GB/s" for name in names)
    ratio = f" | {names[1]} / this tree |" if len(names) > 1 else " |"
    print(f"| rows | contexts | {header}{ratio}")
    print("|---:|---|" + "---:|---:|" * len(names) + ("---:|" if len(names) > 1 else ""))
    for spec in args.contexts:
        contexts = [int(c) for c in spec.split(",")]
        caches, tables, lens = decode_batch(contexts, args.block_size)
        q = torch.randn(len(contexts), HEADS, HEAD_DIM)
        outputs = [kernel(q, *caches[0], tables, lens, HEAD_DIM**-0.5) for kernel in kernels.values()]
        for out in outputs[1:]:
            torch.testing.assert_close(out, outputs[0], rtol=1e-5, atol=1e-5)
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name, kernel in kernels.items():
                start = time.perf_counter()
                for k_cache, v_cache in caches:
                    kernel(q, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5)
                times[name].append((time.perf_counter() - start) * 1e3)
        kv_bytes = LAYERS * sum(contexts) * KV_HEADS * HEAD_DIM * 4 * 2
        cells = " | ".join(f"{min(times[n]):.2f} / {statistics.median(times[n]):.2f} | {kv_bytes / min(times[n]) / 1e6:.1f}"
                           for n in names)
        shown = spec if len(spec) <= 40 else spec[:37] + "..."
        tail = f" | {statistics.median(times[names[1]]) / statistics.median(times[names[0]]):.2f}x |" if len(names) > 1 else " |"
        print(f"| {len(contexts)} | {shown} | {cells}{tail}", flush=True)


if __name__ == "__main__":
    main()
