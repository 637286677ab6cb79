"""A/B of whole engine decode steps with one engine feature on and off, in one process.

B requests with chat-like mixed contexts (drawn from `--contexts`: most short, a few long) decode
together; the feature is switched between pairs of steps, so the machine's drift hits both sides
alike. Switches:

- `decode-kernel`: the C++ paged decode kernel vs gather + padded SDPA
- `fused-ops`: the C++ per-layer ops (RMSNorm, residual add, RoPE + cache write, SiLU * up) vs torch's
- `packed-linear`: the matmul on weights packed at load vs `F.linear` on the plain weights
- `panel-gemm`: conveyor's panel matmul vs oneDNN on its own blocked layout (the earlier default)
- `kernels`: every C++ kernel vs none (CONVEYOR_KERNELS=0)

    python benchmarks/ab_steps.py --switch fused-ops --batch-sizes 1 8 32 64 --repeats 10
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

from conveyor import LLM
from conveyor.bench.decode import start_decode_batch
from conveyor.engine.llm_engine import LLMEngine
from conveyor.model import linear, llama
from conveyor.model.ops import ReferenceOps

CHAT_CONTEXTS = [124, 140, 160, 185, 185, 200, 250, 300, 519]


def _env_switch(name: str) -> Callable[[bool], None]:
    def switch(on: bool) -> None:
        os.environ[name] = "1" if on else "0"
    return switch


def _patch_switch(module: object, attr: str, off: Callable) -> Callable[[bool], None]:
    original = getattr(module, attr)

    def switch(on: bool) -> None:
        setattr(module, attr, original if on else off)
    return switch


def _onednn_switch(model: torch.nn.Module) -> Callable[[bool], None]:
    """Off: every panel-packed weight of `model` runs through oneDNN on a copy in oneDNN's layout."""
    plain = {id(m.packed): m.weight for m in model.modules() if getattr(m, "packed", None) is not None}
    plain[id(model.head_packed)] = model.head_weight
    onednn = {key: torch.ops.mkldnn._reorder_linear_weight(w.detach(), 32) for key, w in plain.items()}
    return _patch_switch(linear, "packed_product", lambda x, packed, bias, kernel: torch.ops.mkldnn._linear_pointwise(
        x, onednn[id(packed)], bias, "none", [], ""))


SWITCHES: dict[str, Callable[[torch.nn.Module], Callable[[bool], None]]] = {
    "decode-kernel": lambda model: _patch_switch(llama, "paged_decode_kernel", lambda: None),
    "fused-ops": lambda model: _patch_switch(llama, "layer_ops", lambda dtype: ReferenceOps()),
    "packed-linear": lambda model: _env_switch("CONVEYOR_PACKED_LINEAR"),
    "kernels": lambda model: _env_switch("CONVEYOR_KERNELS"),
    "panel-gemm": _onednn_switch,
}


def time_pairs(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Milliseconds per call of each mode's callable, alternating modes every pair of calls."""
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    for _ in range(repeats):
        for mode, run in runs.items():
            start = time.perf_counter()
            run()
            run()
            times[mode].append((time.perf_counter() - start) / 2 * 1e3)
    return times


def ab_steps(engine: LLMEngine, switch: Callable[[bool], None], batch_sizes: list[int], contexts: list[int],
             repeats: int, labels: tuple[str, str] = ("on", "off")) -> None:
    print(f"| batch | contexts (mean / max) | {labels[0]} step ms (min / median) | {labels[1]} step ms (min / median) "
          f"| {labels[1]} / {labels[0]} |")
    print("|---:|---:|---:|---:|---:|")
    for batch in batch_sizes:
        ids = start_decode_batch(engine, batch, contexts, 4 * repeats)
        lens = [engine.scheduler.requests[i].num_prompt_tokens for i in ids]

        def step_with(on: bool) -> Callable[[], object]:
            return lambda: (switch(on), engine.step())

        times = time_pairs({"on": step_with(True), "off": step_with(False)}, repeats)
        switch(True)
        for request_id in ids:
            engine.abort_request(request_id)
        on, off = times["on"], times["off"]
        print(f"| {batch} | {statistics.mean(lens):.0f} / {max(lens)} | {min(on):.1f} / {statistics.median(on):.1f} "
              f"| {min(off):.1f} / {statistics.median(off):.1f} | {statistics.median(off) / statistics.median(on):.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", choices=list(SWITCHES), required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=CHAT_CONTEXTS)
    parser.add_argument("--repeats", type=int, default=10, help="pairs of steps timed per side")
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    llm = LLM(None, max_num_seqs=max(args.batch_sizes), num_threads=args.num_threads)
    switch = SWITCHES[args.switch](llm.engine.runner.model)
    ab_steps(llm.engine, switch, args.batch_sizes, args.contexts, args.repeats)


if __name__ == "__main__":
    main()
