"""The KV cache's dtype on the real default model (SmolLM2-135M): float16 by default for an fp32
model, as llama.cpp's cache; twice the tokens in the same memory; next-token choices that stay the
exact path's."""
from __future__ import annotations

import numpy as np
import pytest

from conveyor.bench.quality import EXACT, code_text, score
from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import ConfigError
from conveyor.runner.model_runner import LoadedModel, kv_cache_dtype
from conveyor.sampling import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Once upon a time, in a small village at the edge of a great forest, there lived",
           "<|im_start|>user\nWhat is 12 times 12?<|im_end|>\n<|im_start|>assistant\n"]


def engine(loaded: LoadedModel, **kwargs: object) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig.from_kwargs(activation_dtype="float32", **kwargs), loaded)


def test_default_cache_is_float16_and_holds_twice_the_tokens(default_model: LoadedModel) -> None:
    half, full = engine(default_model, kv_cache_memory="32MiB"), engine(default_model, kv_cache_memory="32MiB",
                                                                        kv_cache_dtype="float32")
    assert {c.dtype for pair in half.runner.kv_caches for c in pair} == {np.dtype(np.float16)}
    assert {c.dtype for pair in full.runner.kv_caches for c in pair} == {np.dtype(np.float32)}
    full_blocks = full.scheduler.kv.num_blocks
    assert half.scheduler.kv.num_blocks in (2 * full_blocks, 2 * full_blocks + 1)  # each the most that fit
    for e in (half, full):
        assert 31 * 2**20 < sum(c.nbytes for pair in e.runner.kv_caches for c in pair) <= 32 * 2**20


def test_auto_is_float16_and_bad_values_are_refused() -> None:
    assert kv_cache_dtype("auto", "float32") == np.float16
    # a bf16 model's too: its activations, and so its keys and values, are fp32 (under torch a bf16
    # model's cache was bf16, as vLLM's; numpy has no bf16, and the attention kernels read fp16 or fp32)
    assert kv_cache_dtype("auto", "bfloat16") == np.float16
    assert kv_cache_dtype("float32", "float32") == np.float32
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


def test_float16_cache_keeps_the_exact_paths_choices(default_model: LoadedModel) -> None:
    """Teacher-forced on standard-library code, the float16 cache (fp32 activations) chooses the exact
    path's next token at nearly every position, at the same perplexity. A cache read back wrongly (a
    misplaced or unconverted element) drops both at once."""
    ids = default_model.tokenizer.encode(code_text())[:1024]
    ref, test, agreement, _ = score(default_model.model, ids, 256, (EXACT, ("float32", np.dtype(np.float16))))
    ppl_ratio = np.exp(np.mean(test)) / np.exp(np.mean(ref))
    assert agreement >= 0.995 and abs(float(ppl_ratio) - 1.0) < 1e-3


def test_greedy_generations_stay_the_exact_caches(default_model: LoadedModel) -> None:
    """Whole greedy generations through the engine (prefill kernel, decode kernel, batches): the same
    first tokens with either cache on every prompt, the same text on most."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [default_model.tokenizer.encode(p) for p in PROMPTS]

    def generate(**kwargs: object) -> list[list[int]]:
        e = engine(default_model, max_num_seqs=len(prompts), **kwargs)
        ids = [e.add_request(p, params) for p in prompts]
        done: dict[str, list[int]] = {}
        while e.has_unfinished_requests:
            done.update({o.request_id: list(o.token_ids) for o in e.step() if o.finished})
        assert e.scheduler.kv.pool.num_free == e.scheduler.kv.num_blocks
        return [done[i] for i in ids]

    half, full = generate(), generate(kv_cache_dtype="float32")
    assert all(h[:8] == f[:8] for h, f in zip(half, full))
    assert sum(h == f for h, f in zip(half, full)) >= len(prompts) - 1
