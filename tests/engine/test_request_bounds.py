"""Per-request values are validated and bounded at add_request, before the request shares a step
(issue 18, cases 1 and 4): a value that would overflow or turn the logits to NaN inside the shared
step must neither fail the batch nor produce garbage."""
from __future__ import annotations

import math

import pytest

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import InvalidRequestError
from conveyor.sampling import SamplingParams
from tests.engine.test_engine_api import finish_all
from tests.fakes import FakeRunner

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_top_k_beyond_int64_is_clipped_to_the_vocabulary_and_spares_the_batch(make_engine):
    engine = make_engine()
    good = engine.add_request("The capital of France is", GREEDY)
    huge = engine.add_request("Once upon a time", SamplingParams(max_tokens=8, temperature=0.8, top_k=2**63,
                                                                  seed=5, ignore_eos=True))
    results = finish_all(engine)
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks
    clean = make_engine()
    alone = clean.add_request("The capital of France is", GREEDY)
    off = clean.add_request("Once upon a time", SamplingParams(max_tokens=8, temperature=0.8, top_k=0, seed=5,
                                                               ignore_eos=True))
    expected = finish_all(clean)
    assert results[good].token_ids == expected[alone].token_ids
    # A top_k at or above the vocabulary keeps every token: the same draws as top-k off.
    assert results[huge].token_ids == expected[off].token_ids


def test_a_temperature_under_epsilon_is_greedy(make_engine):
    engine = make_engine()
    tiny = engine.add_request("The capital of France is", SamplingParams(max_tokens=8, temperature=1e-50,
                                                                         ignore_eos=True))
    greedy = engine.add_request("The capital of France is", GREEDY)
    results = finish_all(engine)
    assert results[tiny].token_ids == results[greedy].token_ids
    assert engine.tokenizer.decode(results[tiny].token_ids).startswith(" Paris")


@pytest.mark.parametrize("field,value", [
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan), ("top_p", -math.inf),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("top_k", -2), ("max_tokens", 0),
])
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_a_field_changed_after_construction_is_checked_again_at_add_request():
    engine = LLMEngine(EngineConfig(num_kv_blocks=8), FakeRunner(), num_kv_blocks=8, max_model_len=64,
                       vocab_size=1000)
    params = SamplingParams(max_tokens=4)
    params.temperature = math.nan
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.add_request([1, 2, 3], params)
    assert not engine.has_unfinished_requests
    params = SamplingParams(max_tokens=4, top_k=10**30)
    rid = engine.add_request([1, 2, 3], params)
    assert engine.scheduler.requests[rid].sampling_params.top_k == 1000
    assert params.top_k == 10**30  # the caller's object is left alone


def test_max_tokens_none_runs_until_the_context_is_full():
    """vLLM's SamplingParams(max_tokens=None): the engine sets what the prompt leaves (of the
    context, or of the KV cache where that is smaller), and the caller's object is left alone."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=8), FakeRunner(), num_kv_blocks=8, max_model_len=40,
                       vocab_size=1000)
    params = SamplingParams(max_tokens=None, ignore_eos=True, min_tokens=5)
    rid = engine.add_request([1, 2, 3], params)
    assert engine.scheduler.requests[rid].sampling_params.max_tokens == 37 and params.max_tokens is None
    result = finish_all(engine)[rid]
    assert len(result.token_ids) == 37 and result.finish_reason == "length"
    small_pool = LLMEngine(EngineConfig(num_kv_blocks=2), FakeRunner(), num_kv_blocks=2, max_model_len=40,
                           vocab_size=1000)  # 2 blocks of 16 tokens hold less than the context
    rid = small_pool.add_request([1, 2, 3], params)
    assert small_pool.scheduler.requests[rid].sampling_params.max_tokens == 29
    with pytest.raises(InvalidRequestError, match="leaves no room") as refused:  # the prompt is at fault
        engine.add_request(list(range(40)), params)
    assert refused.value.param == "prompt"
    unchunked = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=8, chunked_prefill=False, max_num_batched_tokens=24),
                          FakeRunner(), num_kv_blocks=8, max_model_len=40, vocab_size=1000)
    rid = unchunked.add_request([1, 2, 3], params)  # one step computes a recomputed request whole: 24 tokens
    assert unchunked.capacity == 24 and unchunked.scheduler.requests[rid].sampling_params.max_tokens == 21
    with pytest.raises(InvalidRequestError, match="max_tokens must be at least 1 .or None"):
        SamplingParams(max_tokens=0)
