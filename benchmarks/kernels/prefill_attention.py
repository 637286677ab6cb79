"""Prefill attention: conveyor's kernel (kernels/paged_prefill.cpp) against the numpy reference
(attention.py's fallback: a masked softmax in numpy), alone and inside whole prefills of the real model.

Part 1 times one layer's attention of a chunk (`attend` on one prefill chunk, the kernel given or
not) on the model's shapes (fresh prompts of 256-2048 tokens, and cache hits: 32 new tokens after
1,024 cached, 512 after 512), the two alternated repeat by repeat. Part 2 times whole prefills (a
prompt of random token ids, one output token, so the time is the prefill and its first token) on
the model, the kernel on and off (CONVEYOR_PREFILL_ATTENTION) alternated in one process, and checks
both give the same token.

    python benchmarks/kernels/prefill_attention.py --model smollm2-135m --lengths 256 1024 2048 --repeats 5
    python benchmarks/kernels/prefill_attention.py --model gemma3-270m --lengths 1024 2048
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Callable

import numpy as np

from conveyor.engine.llm import LLM
from conveyor.model.attention import AttentionMetadata, PrefillChunk, attend
from conveyor.model.kernels import PagedPrefillKernel, paged_prefill_kernel
from conveyor.model.threads import set_num_threads
from conveyor.sampling import SamplingParams


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_chunk(kernel: PagedPrefillKernel, heads: int, kv_heads: int, d: int, n: int, cached: int,
              repeats: int) -> tuple[list[float], list[float]]:
    """The numpy reference's and the kernel's times for a chunk of n queries after `cached` positions."""
    total, block_size = n + cached, 16
    blocks = -(-total // block_size)
    rng = np.random.default_rng(0)
    k_cache, v_cache = (rng.standard_normal((blocks, block_size, kv_heads, d), dtype=np.float32) for _ in range(2))
    table, q = np.arange(blocks, dtype=np.int64), rng.standard_normal((n, heads, d), dtype=np.float32)
    # the chunk's own keys and values, already in the cache (as rope_and_cache leaves them)
    k, v = k_cache.reshape(-1, kv_heads, d)[cached:total], v_cache.reshape(-1, kv_heads, d)[cached:total]
    meta = AttentionMetadata(slot_mapping=np.arange(cached, total, dtype=np.int64), num_decode_tokens=0,
                             decode_block_tables=None, decode_context_lens=None,
                             prefills=[PrefillChunk(0, n, cached, table)])

    def reference() -> np.ndarray:  # attention.py's fallback: its own keys when fresh, gathered after cached tokens
        return attend(q, k, v, k_cache, v_cache, meta, d**-0.5, decode_kernel=None, prefill_kernel=None)

    def ours() -> np.ndarray:
        return attend(q, k, v, k_cache, v_cache, meta, d**-0.5, decode_kernel=None, prefill_kernel=kernel)

    np.testing.assert_allclose(ours(), reference(), rtol=1e-4, atol=1e-4)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        times[0].append(timed(reference))
        times[1].append(timed(ours))
    return times


def layer_attention(heads: int, kv_heads: int, d: int, lengths: list[int], repeats: int) -> None:
    kernel = paged_prefill_kernel()
    assert kernel is not None, "the prefill kernel is not available here"
    print("| chunk (new + cached) | numpy ms (min / median) | kernel ms | numpy / kernel |")
    print("|---|---:|---:|---:|")
    for n, cached in [(n, 0) for n in lengths] + [(32, 1024), (512, 512)]:
        s, k = one_chunk(kernel, heads, kv_heads, d, n, cached, repeats)
        print(f"| {n} + {cached} | {1e3 * min(s):.2f} / {1e3 * statistics.median(s):.2f} "
              f"| {1e3 * min(k):.2f} / {1e3 * statistics.median(k):.2f} | {min(s) / min(k):.2f}x |")


def whole_prefills(llm: LLM, lengths: list[int], repeats: int) -> None:
    vocab = llm.engine.runner.model.cfg.vocab_size  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    print("| prompt tokens | numpy s (min / median) | kernel s | numpy / kernel | same first token |")
    print("|---:|---:|---:|---:|---|")
    for n in lengths:
        times: dict[str, list[float]] = {"0": [], "1": []}
        tokens: dict[str, list[int]] = {"0": [], "1": []}
        prompts = [[rng.randrange(vocab) for _ in range(n)] for _ in range(repeats + 1)]
        for i, prompt in enumerate(prompts):
            for switch in ("0", "1"):
                os.environ["CONVEYOR_PREFILL_ATTENTION"] = switch
                start = time.perf_counter()
                out = llm.generate(prompt, params)[0]
                if i:  # the first round warms up
                    times[switch].append(time.perf_counter() - start)
                    tokens[switch].append(out.token_ids[0])
        os.environ.pop("CONVEYOR_PREFILL_ATTENTION")
        s, k = times["0"], times["1"]
        print(f"| {n} | {min(s):.3f} / {statistics.median(s):.3f} | {min(k):.3f} / {statistics.median(k):.3f} "
              f"| {min(s) / min(k):.2f}x | {tokens['0'] == tokens['1']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    set_num_threads(2)
    llm = LLM(args.model, enable_prefix_caching=False, max_model_len=max(args.lengths) + 16,
              max_num_batched_tokens=max(args.lengths))
    cfg = llm.engine.runner.model.cfg  # type: ignore[attr-defined]
    print(f"{args.model}: {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads of {cfg.head_dim}, {cfg.num_layers} layers\n")
    layer_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, args.lengths, args.repeats)
    print()
    whole_prefills(llm, args.lengths, args.repeats)


if __name__ == "__main__":
    main()
