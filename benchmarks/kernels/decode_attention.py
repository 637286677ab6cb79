"""The paged decode kernel on its own, cold, against the same kernel at another commit.

Builds a model's worth of fp32 KV caches (`--shape`: SmolLM2-135M's 30 layers of 3 KV heads x 64
with 9 query heads, the default; Gemma 3 270M's 18 layers of 1 x 256 with 4; a Llama-3-8B-like 4
layers of 8 x 128 with 32) with each request's blocks scattered through the pool, and times one
pass of the kernel over all layers for each set of context lengths (one set = one decode batch).
`--share G:P`: the rows fall into G groups whose members hold the same blocks for their first P
tokens, as requests hitting the prefix cache do (the `prefix` workload: 4:1024). `--baseline REV`
builds `conveyor/model/kernels/paged_decode.cpp` as it was at git revision REV under another name
and alternates the two repeat by repeat, so the machine's drift hits both alike; outputs are
checked to agree first.

    python benchmarks/kernels/decode_attention.py --baseline d0edcf0~2 --contexts 1400 1000,1400,600 \\
        1400,1400,1400,300,300,200 1000,1200,1400,600,1000,1200,1400,600
    python benchmarks/kernels/decode_attention.py --baseline HEAD~1 --share 4:1024 --contexts 1056x32
    python benchmarks/kernels/decode_attention.py --baseline HEAD~1 --shape gemma3 --contexts 500 300x32
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
from kernel_at import kernel_at

from conveyor.model.kernels import paged_decode_kernel
from conveyor.model.threads import set_num_threads

SHAPES = {"smollm2": (30, 3, 9, 64), "gemma3": (18, 1, 4, 256), "llama8b": (4, 8, 32, 128)}  # layers, KV heads, heads, dim


def decode_batch(contexts: list[int], block_size: int, layers: int, kv_heads: int, head_dim: int,
                 share: tuple[int, int] | None = None, seed: int = 0):
    """Per-layer caches holding just these requests' blocks, in shuffled order, and their tables.
    `share` (groups, tokens): row i holds group i % groups's blocks for its first `tokens` tokens."""
    groups, shared_blocks = (share[0], share[1] // block_size) if share else (0, 0)
    blocks = [-(-c // block_size) for c in contexts]
    own = [n - min(n, shared_blocks) if groups else n for n in blocks]
    pool = sum(own) + groups * shared_blocks + 8
    rng = np.random.default_rng(seed)
    caches = [tuple(rng.standard_normal((pool, block_size, kv_heads, head_dim), dtype=np.float32) for _ in range(2))
              for _ in range(layers)]
    order = list(range(pool))
    random.Random(seed).shuffle(order)
    prefixes = [order[g * shared_blocks:(g + 1) * shared_blocks] for g in range(groups)]
    taken = groups * shared_blocks
    tables = np.zeros((len(contexts), max(blocks)), dtype=np.int64)
    for row, n in enumerate(blocks):
        head = prefixes[row % groups][:n] if groups else []
        tables[row, :n] = head + order[taken:taken + n - len(head)]
        taken += n - len(head)
    return caches, tables, np.array(contexts, dtype=np.int64)


def parse_contexts(spec: str) -> list[int]:
    """"1000,1400" -> [1000, 1400]; "1056x32" -> 32 rows of 1,056."""
    contexts: list[int] = []
    for part in spec.split(","):
        length, _, count = part.partition("x")
        contexts += [int(length)] * int(count or 1)
    return contexts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", nargs="+", required=True,
                        help="comma-separated context lengths (LENxROWS repeats one), one batch each")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--share", help="G:P: rows in G groups sharing their first P tokens' blocks")
    parser.add_argument("--baseline", help="git revision whose kernel to time beside the working tree's")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    layers, kv_heads, heads, head_dim = SHAPES[args.shape]
    share = tuple(int(v) for v in args.share.split(":")) if args.share else None
    set_num_threads(args.num_threads)
    current = paged_decode_kernel()
    if current is None:
        raise SystemExit("the decode kernel is not available here (no compiler, or CONVEYOR_KERNELS=0)")
    kernels = {"this tree": current}
    if args.baseline:
        baseline = kernel_at(args.baseline, "paged_decode")
        baseline.set_num_threads(args.num_threads)  # type: ignore[attr-defined]
        kernels[args.baseline] = baseline.paged_decode_attention  # type: ignore[attr-defined]
    names = list(kernels)
    header = " | ".join(f"{name} ms (min / median) | GB/s" for name in names)
    ratio = f" | {names[1]} / this tree |" if len(names) > 1 else " |"
    print(f"| rows | contexts | {header}{ratio}")
    print("|---:|---|" + "---:|---:|" * len(names) + ("---:|" if len(names) > 1 else ""))
    for spec in args.contexts:
        contexts = parse_contexts(spec)
        caches, tables, lens = decode_batch(contexts, args.block_size, layers, kv_heads, head_dim, share)  # type: ignore[arg-type]
        q = np.random.default_rng(1).standard_normal((len(contexts), heads, head_dim), dtype=np.float32)
        outputs = [kernel(q, *caches[0], tables, lens, head_dim**-0.5) for kernel in kernels.values()]
        for out in outputs[1:]:
            np.testing.assert_allclose(out, outputs[0], rtol=1e-5, atol=1e-5)
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name, kernel in kernels.items():
                start = time.perf_counter()
                for k_cache, v_cache in caches:
                    kernel(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
                times[name].append((time.perf_counter() - start) * 1e3)
        kv_bytes = layers * sum(contexts) * kv_heads * head_dim * 4 * 2  # as each row reads it, shared or not
        cells = " | ".join(f"{min(times[n]):.2f} / {statistics.median(times[n]):.2f} | {kv_bytes / min(times[n]) / 1e6:.1f}"
                           for n in names)
        shown = spec if len(spec) <= 40 else spec[:37] + "..."
        tail = f" | {statistics.median(times[names[1]]) / statistics.median(times[names[0]]):.2f}x |" if len(names) > 1 else " |"
        print(f"| {len(contexts)} | {shown} | {cells}{tail}", flush=True)


if __name__ == "__main__":
    main()
