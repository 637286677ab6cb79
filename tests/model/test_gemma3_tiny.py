"""Gemma 3 on a tiny random checkpoint against transformers: sliding-window layers (window 8, so
short prompts cross it), a global layer, per-kind RoPE bases, the 1 + weight norms, the sandwich
norms, GELU(tanh), the scaled embedding, query_pre_attn_scalar and the final logit softcap."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conveyor import LLM, SamplingParams
from conveyor.model.loader import load_checkpoint
from tests.helpers import make_tiny_hf_checkpoint

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3", num_layers=3, tie_word_embeddings=True,
                                   layer_types=LAYER_TYPES)


def test_tiny_gemma3_config(tiny_gemma3: Path) -> None:
    c = load_checkpoint(str(tiny_gemma3)).config
    assert c.architecture == "Gemma3ForCausalLM" and c.layer_types == tuple(LAYER_TYPES)
    assert [c.window(i) for i in range(3)] == [8, None, 8]
    assert (c.rope_theta, c.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert c.attention_scale == 24**-0.5 and c.final_logit_softcapping == 30.0
    assert c.qk_norm and c.sandwich_norms and c.scale_embeddings and c.norm_weight_offset == 1.0


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_tiny_gemma3_generates_what_transformers_generates(
    tiny_gemma3: Path, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts shorter and longer than the window, decoding well past it, batched, in prefill
    chunks of 5 tokens (so chunks straddle the window's edge) over blocks of 4."""
    import torch  # the reference only: transformers runs on torch
    from transformers import AutoModelForCausalLM

    prompts = [[1, *range(100 + 37 * i, 100 + 37 * i + n)] for i, n in enumerate([2, 6, 7, 8, 12, 19])]
    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=20, do_sample=False, eos_token_id=None)[0, len(p):].tolist()
                for p in prompts]
    monkeypatch.setenv("CONVEYOR_KERNELS", kernels)
    llm = LLM(str(tiny_gemma3), max_num_seqs=6, max_num_batched_tokens=5, block_size=4, kv_cache_dtype="float32")
    got = [list(out.token_ids) for out in llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0,
                                                                                ignore_eos=True))]
    assert got == want


def _generate(model: Path, prompts: list[list[int]], params: SamplingParams, **options: object) -> tuple[LLM, list]:
    # A batch cap of 16 for 6 requests: the window pool, sized for the cap, has room to keep what
    # finished requests' last queries saw (the blocks a next turn's hit needs) while others run.
    llm = LLM(str(model), max_num_seqs=16, max_num_batched_tokens=5, block_size=4, kv_cache_dtype="float32",
              **options)
    return llm, [(list(out.token_ids), out.num_cached_tokens) for out in llm.generate(prompts, params)]


def test_the_window_pool_changes_no_token_and_holds_less(tiny_gemma3: Path) -> None:
    """Sliding-window layers in a pool of their own (window 8 over blocks of 4: a request gives back
    a block every 4 tokens past its first 8) against every layer keeping the whole context: the same
    tokens, greedy and seeded, n = 2 (forks share blocks, then copy the tail), speculative
    proposals accepted and rejected, and a second turn of each conversation, which hits the prefix
    cache as far as the window pool still holds what its next query sees."""
    prompts = [[1, *range(100 + 37 * i, 100 + 37 * i + n)] for i, n in enumerate([3, 17, 38])]
    repetitive = [1, *([200, 201, 202, 203, 204] * 6)]  # what n-gram proposals find
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=11, n=2, ignore_eos=True)
    results = {}
    for pool in (True, False):
        llm, first = _generate(tiny_gemma3, prompts + [repetitive], greedy, window_kv_pool=pool)
        turns = [p + tokens + [7, 8, 9] for p, (tokens, _) in zip(prompts, first)]
        again = [(list(o.token_ids), o.num_cached_tokens) for o in llm.generate(turns, greedy)]
        # Prompts not seen before: a prefix hit computes the rest of a prompt in other chunks than a
        # whole prefill does, which may move a logit in its last bits (and a sampled token with it).
        forks = [list(o.token_ids) for o in llm.generate([[2, *p[1:]] for p in prompts[2:]], sampled)]
        kv, runner = llm.engine.scheduler.kv, llm.engine.runner
        assert kv.usage().used_blocks == 0 and kv.usage().window_used_blocks == 0
        blocks = sorted({k.shape[0] for k, _ in runner.kv_caches})
        if pool:
            assert kv.window is not None and kv.window.tokens == 8
            assert blocks == [kv.window.num_blocks, kv.num_blocks] and kv.window.num_blocks < kv.num_blocks
            assert all(cached >= len(p) for p, (_, cached) in zip(prompts, again)), "second turns hit the cache"
        else:
            assert kv.window is None and blocks == [kv.num_blocks]
        _, spec = _generate(tiny_gemma3, [repetitive, prompts[2]], greedy, window_kv_pool=pool,
                            speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                "prompt_lookup_min": 2})
        results[pool] = (first, again, forks, [t for t, _ in spec])
    assert results[True] == results[False]
    first = [tokens for tokens, _ in results[True][0]]
    assert results[True][3] == [first[3], first[2]], "speculation changed a token"


def test_a_failing_request_leaves_the_window_pool_right(tiny_gemma3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Failure isolation retries a step without the request that makes it raise: the retry keeps
    the window pool's tables and copies (without them its sliding layers would take the main pool's
    slots), and the others' tokens are a clean run's."""
    from conveyor.errors import RequestFailedError

    prompts = [[1, *range(300 + 41 * i, 300 + 41 * i + n)] for i, n in enumerate([6, 13, 21])]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    _, clean = _generate(tiny_gemma3, prompts, params)
    llm = LLM(str(tiny_gemma3), max_num_seqs=16, max_num_batched_tokens=5, block_size=4, kv_cache_dtype="float32")
    model, poison = llm.engine.runner.model, 999
    original = model.sampling_hidden

    def failing(input_ids: np.ndarray, *rest: object, **kwargs: object) -> np.ndarray:
        hidden = original(input_ids, *rest, **kwargs)  # the whole forward first: every row's KV written
        if bool((input_ids == poison).any()):
            raise RuntimeError("injected failure")
        return hidden

    monkeypatch.setattr(model, "sampling_hidden", failing)
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in [prompts[0], [1, poison, 5, 6, 7, 8, 9, 10, 11], *prompts[1:]]]
    finished = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert isinstance(finished[ids[1]].error, RequestFailedError)
    assert [list(finished[i].token_ids) for i in ids[:1] + ids[2:]] == [tokens for tokens, _ in clean]
    usage = engine.scheduler.kv.usage()
    assert usage.used_blocks == usage.window_used_blocks == 0
