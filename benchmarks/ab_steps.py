"""A/B of whole engine decode steps with one engine feature on and off, in one process.

B requests with chat-like mixed contexts (drawn from `--contexts`: most short, a few long) decode
together; the feature is switched between pairs of steps, so the machine's drift hits both sides
alike. Switches:

- `decode-kernel`: the C++ paged decode kernel vs gather + a padded, masked softmax in numpy
- `fused-ops`: the C++ per-layer ops (RMSNorm, residual add, RoPE + cache write, SiLU * up) vs
  numpy's (ops.ReferenceOps)
- `packed-linear`: the matmul on weights packed at load vs numpy's matmul on dense fp32 copies of
  them (linear.reference_product)
- `panel-gemm`: conveyor's panel matmul vs oneDNN on its own blocked layout (the earlier default),
  through torch: a peer, run only here (torch must be installed: the test extra)
- `kernels`: every C++ kernel vs none (CONVEYOR_KERNELS=0)
- `argmax`: greedy sampling's vectorised argmax (fused_ops.cpp) vs numpy.argmax (the sampler's own)
- `screened-argmax`: greedy tokens from the int8-screened head (linear.screened_argmax) vs
  the full vocabulary projection and the sampler
- `sampled-head`: rows that sample at a temperature taking the vocabulary projection in the
  activation dtype (LlamaModel.logits) vs in fp32 like greedy rows (use with `--temperature`)
- `vector-span`: decode attention's rows that stream blocks of their own on the register-blocked
  span vs the token-by-token walk (the paged decode kernel's `unshared_span`, both forced; which one
  a build runs by default is kUnsharedSpan in paged_decode.cpp)
- `decode-kernel-at`: the paged decode kernel of this tree vs its source at `--baseline REV`
- `prefill-kernel-at`: the paged prefill attention kernel of this tree vs its source at `--baseline REV`
- `quant-kernel-at`: the matmul on GGUF blocks (quant_gemm.cpp) of this tree vs its source at
  `--baseline REV` (same packed layout)
- `int8-kernel-at`: the int8-activation matmul (quant_int8.cpp) of this tree vs its source at
  `--baseline REV`
- `prompt-tiles`: prompt tokens' products on AMX bf16 tiles vs on the int8 kernel like generated
  tokens (EngineConfig.prompt_bf16_tiles; CPUs with AMX-BF16)
- `layer-rows`: a step's layers in runs of at most memory.LAYER_ROWS rows vs all of its rows at once,
  or runs of `--rows-off` rows (what a prefill holds: use with `--prefill`)
- `window-kv-pool`: a model's sliding-window layers keeping only their window's KV in a pool of their
  own (EngineConfig.window_kv_pool) vs the whole context on every layer: two engines on one loaded
  model, each with its own requests, stepped in alternation (Gemma 3)
- `half-weights`: weights a checkpoint stores as F16 / BF16 (an HF bf16 folder, an F16 GGUF) in their
  16-bit panels vs fp32 panels of the same values (what serving such a checkpoint in fp32 held before);
  on a CPU with AVX512-BF16 the BF16 side multiplies in bf16 with the default activations (the
  exact comparison: `conveyor bench steps --activation-dtypes float32 int8` for that instead)

    python benchmarks/ab_steps.py --switch fused-ops --batch-sizes 1 8 32 64 --repeats 10
    python benchmarks/ab_steps.py --switch argmax --model gemma3-270m --batch-sizes 1 32 --repeats 20
    python benchmarks/ab_steps.py --switch screened-argmax --model gemma3-270m --batch-sizes 1 8 32 --repeats 20
    python benchmarks/ab_steps.py --switch vector-span --model qwen2.5-coder-0.5b --batch-sizes 1 16 32 --repeats 8
    python benchmarks/ab_steps.py --switch decode-kernel-at --baseline HEAD~1 --model gemma3-270m --batch-sizes 1 32
    python benchmarks/ab_steps.py --switch decode-kernel-at --baseline HEAD~1 --batch-sizes 32 --contexts 32 --share 4:1024
    python benchmarks/ab_steps.py --switch quant-kernel-at --baseline HEAD~1 --model gemma3-270m --batch-sizes 1 8 32
    python benchmarks/ab_steps.py --switch int8-kernel-at --baseline HEAD~1 --model qwen2.5-coder-0.5b --prefill 512
    python benchmarks/ab_steps.py --switch half-weights --model out/qwen-bf16 --batch-sizes 1 16 32 --prefill 512
    python benchmarks/ab_steps.py --switch prompt-tiles --model qwen2.5-coder-0.5b --batch-sizes 1 16 --prefill 512
    python benchmarks/ab_steps.py --switch layer-rows --model qwen2.5-coder-0.5b --batch-sizes 1 32 --prefill 2048
    python benchmarks/ab_steps.py --switch sampled-head --temperature 0.8 --model qwen2.5-coder-0.5b --batch-sizes 1 16 32
    python benchmarks/ab_steps.py --switch window-kv-pool --model gemma3-270m --batch-sizes 1 32 --prefill 2048
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from conveyor import LLM
from conveyor.bench.decode import start_decode_batch
from conveyor.bench.steps import time_prefill
from conveyor.engine.llm_engine import LLMEngine
from conveyor.model import kernels, linear, llama, memory
from conveyor.model.linear import Embedding, Linear, PackedWeight, pack_weight, reference_product, screen_norms
from conveyor.model.llama import LlamaModel
from conveyor.model.memory import reuse_freed_memory, step_working_set_bytes
from conveyor.model.ops import ReferenceOps
from conveyor.model.quantized import HALF_TYPES
from conveyor.runner.model_runner import LoadedModel, ModelRunner
from conveyor.sampling.sampler import numpy_argmax

# benchmarks/kernels by its path: an installed package named `kernels` (transformers depends on one)
# would win over the directory as a namespace package.
sys.path.insert(0, str(Path(__file__).resolve().parent / "kernels"))
from kernel_at import kernel_at  # noqa: E402

CHAT_CONTEXTS = [124, 140, 160, 185, 185, 200, 250, 300, 519]


def _env_switch(name: str) -> Callable[[bool], None]:
    def switch(on: bool) -> None:
        os.environ[name] = "1" if on else "0"
    return switch


def _patch_switch(module: object, attr: str, off: object) -> Callable[[bool], None]:
    original = getattr(module, attr)

    def switch(on: bool) -> None:
        setattr(module, attr, original if on else off)
    return switch


def _dense_rows(packed: PackedWeight) -> np.ndarray:
    """The packed weight's fp32 values, [out_features, in_features]."""
    return np.concatenate([leaf.rows(np.arange(leaf.out_features)) for leaf in packed.parts or (packed,)])


def _dense_copies(model: LlamaModel) -> dict[int, np.ndarray]:
    """A dense fp32 copy of each packed weight of `model` (weights are held once, packed), by id."""
    return {id(m.packed): _dense_rows(m.packed) for m in model.modules() if m.packed is not None}


def _dense_switch(model: LlamaModel, product: Callable[[np.ndarray, Any, np.ndarray | None], np.ndarray],
                  prepare: Callable[[np.ndarray], Any] = lambda w: w) -> Callable[[bool], None]:
    """Off: every packed weight of `model` multiplies as product(x, prepare(its dense fp32 copy), bias)."""
    dense = {key: prepare(w) for key, w in _dense_copies(model).items()}
    original = linear.packed_product

    def off(x: np.ndarray, packed: PackedWeight, bias: np.ndarray | None, *kernels: object) -> np.ndarray | None:
        w = dense.get(id(packed))
        return original(x, packed, bias, *kernels) if w is None else product(x, w, bias)
    return _patch_switch(linear, "packed_product", off)


def _onednn_switch(model: LlamaModel) -> Callable[[bool], None]:
    """Off: every packed weight of `model` runs through oneDNN on a copy in oneDNN's layout: torch's,
    a peer (imported here only; x and the result cross without a copy), on the kernels' threads."""
    try:
        import torch
    except ImportError:
        raise SystemExit("--switch panel-gemm compares with oneDNN through torch, which is not installed") from None
    torch.set_num_threads(kernels.get_num_threads())

    def onednn(x: np.ndarray, w: Any, bias: np.ndarray | None) -> np.ndarray:
        b = None if bias is None else torch.from_numpy(bias)
        y = torch.ops.mkldnn._linear_pointwise(torch.from_numpy(np.ascontiguousarray(x)), w, b, "none", [], "")
        return y.numpy()
    return _dense_switch(model, onednn, lambda w: torch.ops.mkldnn._reorder_linear_weight(torch.from_numpy(w), 32))


def _half_weights_switch(model: LlamaModel) -> Callable[[bool], None]:
    """Off: every weight held in F16 / BF16 panels runs on fp32 panels of the same values."""
    def leaves(p: PackedWeight) -> tuple[PackedWeight, ...]:
        return p.parts or (p,)

    def fp32_panels(p: PackedWeight) -> PackedWeight:
        dense = _dense_rows(p)
        panels = pack_weight(dense)
        assert panels is not None and panels.layout == "panels"
        return panels
    held = {m: m.packed for m in model.modules() if isinstance(m, (Linear, Embedding)) and m.packed is not None
            and any(leaf.layout in HALF_TYPES for leaf in leaves(m.packed))}
    if not held:
        raise SystemExit("--switch half-weights: the model holds no F16 / BF16 weights")
    fp32 = {m: fp32_panels(p) for m, p in held.items()}
    norms = getattr(model, "head_norms", None)  # greedy's screen reads the head's norms: kept in step

    def switch(on: bool) -> None:
        for m in held:
            m.packed = held[m] if on else fp32[m]
        if hasattr(model, "head_norms"):
            model.head_norms = norms if on else screen_norms(model.head.packed)  # type: ignore[attr-defined]
    return switch


def _unshared_span_switch() -> Callable[[bool], None]:
    """On: every unshared row on VectorSpan; off: on the token walk (paged_decode.cpp's two spans)."""
    kernel = llama.paged_decode_kernel()
    if kernel is None:
        raise SystemExit("--switch vector-span: the paged decode kernel is not available")
    vector, token = (functools.partial(kernel, unshared_span=span) for span in ("vector", "token"))

    def switch(on: bool) -> None:
        chosen = vector if on else token
        llama.paged_decode_kernel = lambda: chosen  # type: ignore[assignment]
    return switch


def _prompt_tiles_switch(runner: ModelRunner) -> Callable[[bool], None]:
    """Off: prompt tokens on the int8 kernel like generated ones (EngineConfig.prompt_bf16_tiles)."""
    if not runner.prompt_bf16_tiles:
        raise SystemExit("--switch prompt-tiles: this CPU (or build) has no AMX-BF16 tiles, or the engine runs fp32")
    return _patch_switch(runner, "prompt_bf16_tiles", False)


def _layer_rows_switch(runner: ModelRunner, rows_off: int | None) -> Callable[[bool], None]:
    """Off: a step's layers take `rows_off` rows at a time (None: all of its rows at once, memory.LAYER_ROWS
    unbounded). Steps then keep free heap for the larger working set on both sides (twice a whole
    4,096-row step's, above any `--prefill` the default budget allows), so that neither side's page
    faults decide the figure."""
    reuse_freed_memory(2 * 4096 * step_working_set_bytes(runner.model_config, 1, 0))
    return _patch_switch(memory, "LAYER_ROWS", rows_off or 1 << 30)


SWITCHES: dict[str, Callable[[ModelRunner], Callable[[bool], None]]] = {
    "decode-kernel": lambda runner: _patch_switch(llama, "paged_decode_kernel", lambda: None),
    "fused-ops": lambda runner: _patch_switch(llama, "layer_ops", lambda: ReferenceOps()),
    "packed-linear": lambda runner: _dense_switch(runner.model, reference_product),
    "kernels": lambda runner: _env_switch("CONVEYOR_KERNELS"),
    "panel-gemm": lambda runner: _onednn_switch(runner.model),
    "argmax": lambda runner: _patch_switch(runner.sampler, "_argmax", numpy_argmax),
    "screened-argmax": lambda runner: _patch_switch(runner.model, "greedy_tokens", lambda h: None),
    "half-weights": lambda runner: _half_weights_switch(runner.model),
    "sampled-head": lambda runner: _patch_switch(runner.model, "logits",
                                                 lambda h, sampled=None, exact=runner.model.logits: exact(h)),
    "prompt-tiles": lambda runner: _prompt_tiles_switch(runner),
    "vector-span": lambda runner: _unshared_span_switch(),
}


def _kernel_at(revision: str, name: str) -> Any:
    """The module `name` built from its source at `revision`, on the kernels' thread count."""
    module = kernel_at(revision, name)
    module.set_num_threads(kernels.get_num_threads())  # type: ignore[attr-defined]
    return module


def _decode_kernel_at(revision: str) -> Callable[[bool], None]:
    old = _kernel_at(revision, "paged_decode").paged_decode_attention
    return _patch_switch(llama, "paged_decode_kernel", lambda: old)


def _prefill_kernel_at(revision: str) -> Callable[[bool], None]:
    old = _kernel_at(revision, "paged_prefill").paged_prefill_attention
    return _patch_switch(llama, "paged_prefill_kernel", lambda: old)


def _quant_kernel_at(revision: str) -> Callable[[bool], None]:
    old = _kernel_at(revision, "quant_gemm")
    # linear calls quant_gemm() and, for weights held only in blocks, quant_gemm(force=True)
    return _patch_switch(linear, "quant_gemm", lambda force=False: old)


def _int8_kernel_at(revision: str) -> Callable[[bool], None]:
    old = _kernel_at(revision, "quant_int8")
    return _patch_switch(linear, "int8_matmul_kernel", lambda: old)


AT_REVISION = {"decode-kernel-at": _decode_kernel_at, "prefill-kernel-at": _prefill_kernel_at,
               "quant-kernel-at": _quant_kernel_at,
               "int8-kernel-at": _int8_kernel_at}


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
             repeats: int, labels: tuple[str, str] = ("on", "off"), shared_prefix: tuple[int, int] | None = None,
             temperature: float = 0.0) -> None:
    print(f"| batch | contexts (mean / max) | {labels[0]} step ms (min / median) | {labels[1]} step ms (min / median) "
          f"| {labels[1]} / {labels[0]} |")
    print("|---:|---:|---:|---:|---:|")
    for batch in batch_sizes:
        ids = start_decode_batch(engine, batch, contexts, 4 * repeats, shared_prefix=shared_prefix,
                                 temperature=temperature)
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


def ab_prefill(engine: LLMEngine, switch: Callable[[bool], None], tokens: int, repeats: int,
               labels: tuple[str, str] = ("on", "off")) -> None:
    """A fresh `tokens`-token prompt's prefill (distinct tokens each time: nothing cached), the
    feature switched every prompt, which side goes first alternating."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(repeats):
        for on in (True, False) if repeat % 2 == 0 else (False, True):
            switch(on)
            times[on].append(time_prefill(engine, tokens, seed=2 * repeat + on) * 1e3)
    switch(True)
    on, off = times[True], times[False]
    print(f"| prefill of {tokens} tokens | {labels[0]} ms (min / median) | {labels[1]} ms (min / median) "
          f"| {labels[1]} / {labels[0]} |")
    print("|---:|---:|---:|---:|")
    print(f"| {tokens} | {min(on):.0f} / {statistics.median(on):.0f} | {min(off):.0f} / {statistics.median(off):.0f} "
          f"| {statistics.median(off) / statistics.median(on):.2f}x |")


# Switches that need an engine of their own per side (an option the engine is built with).
ENGINE_OPTIONS = {"window-kv-pool": "window_kv_pool"}


def ab_engines(engines: dict[bool, LLMEngine], batch_sizes: list[int], contexts: list[int], repeats: int,
               prefill: int) -> None:
    """ab_steps and ab_prefill for two engines (the option on and off) sharing one loaded model:
    each decodes a batch of its own (the same prompts), steps taken in alternating pairs."""
    print("| batch | on step ms (min / median) | off step ms (min / median) | off / on |")
    print("|---:|---:|---:|---:|")
    for batch in batch_sizes:
        ids = {on: start_decode_batch(engine, batch, contexts, 4 * repeats) for on, engine in engines.items()}
        times = time_pairs({"on": engines[True].step, "off": engines[False].step}, repeats)
        for on, engine in engines.items():
            for request_id in ids[on]:
                engine.abort_request(request_id)
        a, b = times["on"], times["off"]
        print(f"| {batch} | {min(a):.1f} / {statistics.median(a):.1f} | {min(b):.1f} / {statistics.median(b):.1f} "
              f"| {statistics.median(b) / statistics.median(a):.2f}x |")
    if prefill:
        runs = {on: [] for on in engines}  # type: dict[bool, list[float]]
        for repeat in range(repeats):
            for on in (True, False) if repeat % 2 == 0 else (False, True):
                runs[on].append(time_prefill(engines[on], prefill, seed=2 * repeat + on) * 1e3)
        a, b = runs[True], runs[False]
        print(f"| prefill of {prefill} tokens | on {min(a):.0f} / {statistics.median(a):.0f} ms | off {min(b):.0f} / "
              f"{statistics.median(b):.0f} ms | {statistics.median(b) / statistics.median(a):.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", choices=[*SWITCHES, "layer-rows", *AT_REVISION, *ENGINE_OPTIONS], required=True)
    parser.add_argument("--baseline", help="git revision, for the --switch ...-kernel-at")
    parser.add_argument("--model", default=None, help="smollm2-135m (default), gemma3-270m, a .gguf file")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=CHAT_CONTEXTS)
    parser.add_argument("--repeats", type=int, default=10, help="pairs of steps timed per side")
    parser.add_argument("--share", help="G:P: prompts in G groups starting with the same P tokens (cache hits)")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--rows-off", type=int, default=None,
                        help="for --switch layer-rows: the other side's rows at a time (default: all of a step's)")
    parser.add_argument("--prefill", type=int, default=0, help="N > 0: also A/B a fresh N-token prompt's prefill")
    parser.add_argument("--temperature", type=float, default=0.0, help="the decoding requests sample at T (0: greedy)")
    args = parser.parse_args()
    if args.rows_off is not None and (args.switch != "layer-rows" or args.rows_off < 1):
        parser.error("--rows-off takes a positive number of rows, with --switch layer-rows only")
    if args.switch in AT_REVISION and not args.baseline:
        parser.error(f"--switch {args.switch} needs --baseline REV")
    llm = LLM(args.model, max_num_seqs=max(args.batch_sizes), num_threads=args.num_threads,
              max_num_batched_tokens=max(2048, args.prefill))
    if args.switch in ENGINE_OPTIONS:
        option = ENGINE_OPTIONS[args.switch]
        loaded = LoadedModel(llm.engine.runner.model, llm.engine.runner.tokenizer)
        engines = {on: LLMEngine.from_config(dataclasses.replace(llm.engine.config, **{option: on}), loaded)
                   for on in (True, False)}
        del llm
        ab_engines(engines, args.batch_sizes, args.contexts, args.repeats, args.prefill)
        return
    if args.switch in AT_REVISION:
        switch, labels = AT_REVISION[args.switch](args.baseline), ("this tree", args.baseline)
        if args.switch == "int8-kernel-at" and llm.engine.runner.prompt_bf16_tiles:
            # Both sides' prompts on the int8 kernels compared (a baseline may predate the tiles).
            llm.engine.runner.prompt_bf16_tiles = False
            print("int8-kernel-at: prompts on the int8 kernel too (not the AMX tiles), both sides")
    elif args.switch == "layer-rows":
        switch = _layer_rows_switch(llm.engine.runner, args.rows_off)
        labels = (f"{memory.LAYER_ROWS} rows", f"{args.rows_off} rows" if args.rows_off else "all rows")
    else:
        switch, labels = SWITCHES[args.switch](llm.engine.runner), ("on", "off")
    share = (int(args.share.split(":")[0]), int(args.share.split(":")[1])) if args.share else None
    ab_steps(llm.engine, switch, args.batch_sizes, args.contexts, args.repeats, labels, share, args.temperature)
    if args.prefill:
        ab_prefill(llm.engine, switch, args.prefill, args.repeats, labels)


if __name__ == "__main__":
    main()
