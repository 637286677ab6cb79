"""Acceptance on the real default model: greedy outputs equal HF transformers', and stay the same
however the engine batches, chunks, preempts or which policy it runs."""
from __future__ import annotations

import numpy as np
import pytest

from conveyor.engine.llm_engine import LLMEngine
from conveyor.sampling import SamplingParams

NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "Hi",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter "
    "and his three children. Every morning he walked into the woods with his axe, and every evening",
    "List three primary colors:",
    "Translate to French: I would like a cup of coffee, please.",
    "The quick brown fox jumps over the lazy dog. " * 12 + "What animal jumped?",
    "In 1969, the Apollo 11 mission",
    "<|im_start|>user\nWhat is 12 times 12?<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt_ids(hf_reference_tokenizer) -> list[list[int]]:
    return [hf_reference_tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(hf_reference_model, prompt_ids) -> list[list[int]]:
    import torch  # the reference only: transformers runs on torch

    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            # eos_token_id=None: generate past EOS like ignore_eos (min_new_tokens would instead
            # suppress EOS and so change the argmax). An explicit mask: the pad id is <|im_end|>,
            # which HF would otherwise mask out of the chat prompt as padding.
            full = hf_reference_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
            )
            outputs.append(full[0, len(ids) :].tolist())
    return outputs


def run(engine: LLMEngine, prompts: list[list[int]], arrive_every: int = 0) -> list[list[int]]:
    """Adds prompt i at step i * arrive_every (all at once when 0), runs to completion."""
    ids: list[str] = []
    results: dict[str, list[int]] = {}
    step = 0
    while len(ids) < len(prompts) or engine.has_unfinished_requests:
        while len(ids) < len(prompts) and step >= len(ids) * arrive_every:
            ids.append(engine.add_request(prompts[len(ids)], GREEDY))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = list(out.token_ids)
        step += 1
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks
    return [results[i] for i in ids]


def test_alone_matches_transformers(make_engine, prompt_ids, hf_greedy):
    engine = make_engine()
    alone = [run(engine, [p])[0] for p in prompt_ids]
    for i, (ours, ref) in enumerate(zip(alone, hf_greedy)):
        assert ours == ref, f"prompt {i} {PROMPTS[i][:30]!r} diverged"


@pytest.mark.parametrize(
    "case, engine_kwargs, arrive_every",
    [
        ("staggered continuous", dict(max_num_seqs=8), 3),
        ("tiny chunks", dict(max_num_batched_tokens=7, max_num_seqs=4), 2),
        ("preemption", dict(num_kv_blocks=24, block_size=8, max_num_seqs=8), 0),
        ("static", dict(policy="static", max_num_seqs=4), 1),
        ("static unchunked", dict(policy="static", max_num_seqs=3, chunked_prefill=False), 0),
    ],
)
def test_batching_does_not_change_greedy_tokens(make_engine, prompt_ids, hf_greedy, case, engine_kwargs, arrive_every):
    engine = make_engine(**engine_kwargs)
    outputs = run(engine, prompt_ids, arrive_every)
    if case == "preemption":
        assert engine.scheduler.num_preemptions > 0
    for i, (ours, ref) in enumerate(zip(outputs, hf_greedy)):
        assert ours == ref, f"{case}: prompt {i} {PROMPTS[i][:30]!r} diverged"


def test_gguf_blocks_give_the_dense_fp32_results_bit_for_bit(make_engine, default_model, default_checkpoint, prompt_ids):
    """The default model's matmuls stream its Q4_1 / Q8_0 blocks; an engine on dense fp32 panels
    of the same weights computes the same logprobs exactly."""
    from conveyor.config import EngineConfig
    from conveyor.model.llama import LlamaModel
    from conveyor.runner.model_runner import LoadedModel

    model = default_model.model
    assert model.layers[0].qkv.packed.layout == "Q4_1" and model.head.packed.layout == "Q8_0"
    dense_model = LlamaModel.from_weights(model.cfg, default_checkpoint.weights, "float32")
    assert dense_model.layers[0].qkv.packed.layout == "panels"
    dense = LLMEngine.from_config(EngineConfig(activation_dtype="float32", kv_cache_dtype="float32"),
                                  LoadedModel(dense_model, default_model.tokenizer))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)

    def logprobs(engine: LLMEngine) -> list:
        ids = [engine.add_request(p, params) for p in prompt_ids[:6]]
        steps: dict[str, list] = {i: [] for i in ids}
        while engine.has_unfinished_requests:
            for out in engine.step():
                steps[out.request_id] += out.logprobs  # each output carries its new tokens' logprobs
        assert all(len(s) == params.max_tokens for s in steps.values())
        return [steps[i] for i in ids]

    assert logprobs(make_engine()) == logprobs(dense)


def test_greedy_batches_take_the_screened_head_and_others_the_full_one(make_engine, prompt_ids, hf_greedy,
                                                                         monkeypatch):
    """SmolLM2's Q8_0 head: all-greedy steps skip the full vocabulary projection (same tokens as
    transformers'), a batch with a logprobs request computes the logits for every row."""
    from conveyor.model import llama

    screened_rows: list[int] = []
    plain = llama.screened_argmax

    def recording(x: np.ndarray, packed, norms=None):  # type: ignore[no-untyped-def]
        result = plain(x, packed, norms)
        if result is not None:
            screened_rows.append(x.shape[0])
        return result

    from conveyor.model.kernels import quant_gemm

    if getattr(quant_gemm(), "q8_0_argmax", None) is None:
        pytest.skip("no screened argmax in this build")
    monkeypatch.setattr(llama, "screened_argmax", recording)
    assert run(make_engine(), prompt_ids) == hf_greedy
    assert screened_rows and max(screened_rows) > 1
    screened_rows.clear()
    engine = make_engine()
    logprobs = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    engine.add_request(prompt_ids[0], logprobs)
    engine.add_request(prompt_ids[1], GREEDY)
    while engine.has_unfinished_requests:
        engine.step()
    assert screened_rows and set(screened_rows) == {1}  # only the greedy one, once the logprobs one has ended
