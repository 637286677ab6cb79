"""The engine's request API on the real default model: stopping, rejection, aborts, seeds."""
from __future__ import annotations

import pytest

from conveyor.engine.llm import LLM
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import InvalidRequestError
from conveyor.sampling import SamplingParams


def finish_all(engine: LLMEngine) -> dict:
    results = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    return results


def test_stop_reasons(make_engine):
    engine = make_engine()
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    rid = engine.add_request("The capital of France is", greedy)
    full = finish_all(engine)[rid]
    assert full.finish_reason == "length" and len(full.token_ids) == 24
    full_text = engine.tokenizer.decode(full.token_ids)
    assert full_text.startswith(" Paris.") and full.text is None  # the engine makes no text

    stop_at = full.token_ids[3]
    rid = engine.add_request("The capital of France is", SamplingParams(max_tokens=24, temperature=0.0,
                                                                       stop_token_ids=[stop_at]))
    by_token = finish_all(engine)[rid]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == stop_at
    assert by_token.token_ids == full.token_ids[: full.token_ids.index(stop_at) + 1]
    assert by_token.ended_on_stop_token and not full.ended_on_stop_token
    # The stop token is one of the output's tokens, but its text is left out unless asked for (vLLM).
    token_params = [SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_at], **kept)
                    for kept in ({}, {"include_stop_str_in_output": True})]
    cut, whole = LLM.from_engine(engine).generate(["The capital of France is"] * 2, token_params)
    assert cut.token_ids == whole.token_ids == by_token.token_ids
    assert cut.text == engine.tokenizer.decode(by_token.token_ids[:-1])
    assert whole.text == engine.tokenizer.decode(by_token.token_ids) != cut.text

    # Stop strings are found where the text is made: LLM.generate ends the sample at once.
    params = [SamplingParams(max_tokens=24, temperature=0.0, stop=["answer"]),
              SamplingParams(max_tokens=24, temperature=0.0, stop=["answer"], include_stop_str_in_output=True),
              greedy]
    by_string, kept, plain = LLM.from_engine(engine).generate(["The capital of France is"] * 3, params)
    assert by_string.finish_reason == "stop" and by_string.stop_reason == "answer"
    assert by_string.text == full_text[: full_text.index("answer")]
    assert kept.text == full_text[: full_text.index("answer") + len("answer")]
    assert plain.text == full_text and plain.finish_reason == "length"
    # It stopped on the token that completed the string, and its KV went back at once.
    assert engine.tokenizer.decode(by_string.token_ids[:-1]).find("answer") < 0 <= full_text.find("answer")
    assert "answer" in engine.tokenizer.decode(by_string.token_ids)
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks


def test_stop_sample_frees_one_sample_and_spares_its_siblings(make_engine):
    engine = make_engine()
    rid = engine.add_request("Once upon a time", SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=2,
                                                                ignore_eos=True))
    engine.step()
    free_before = engine.scheduler.kv.pool.num_free
    stopped = engine.stop_sample(rid, 1, "once")
    assert stopped is not None and stopped.finished and stopped.index == 1
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "once"
    assert engine.stop_sample(rid, 1) is None and engine.stop_sample("nope", 0) is None
    assert engine.scheduler.kv.pool.num_free >= free_before  # the fork's own blocks are back
    results = []
    while engine.has_unfinished_requests:
        results += [o for o in engine.step() if o.finished]
    assert [(o.index, len(o.token_ids), o.finish_reason) for o in results] == [(0, 10, "length")]
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks


def test_eos_stops_unless_ignored(make_engine):
    engine = make_engine()
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    rid = engine.add_request(chat, SamplingParams(max_tokens=64, temperature=0.0))
    ignored = engine.add_request(chat, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    results = finish_all(engine)
    out = results[rid]
    assert out.finish_reason == "stop" and out.token_ids[-1] in engine.tokenizer.eos_token_ids
    assert len(out.token_ids) < 64 and engine.tokenizer.decode(out.token_ids).startswith("Hello")
    assert results[ignored].finish_reason == "length" and len(results[ignored].token_ids) == 64
    assert results[ignored].token_ids[: len(out.token_ids)] == out.token_ids


def test_oversized_requests_are_rejected_and_others_keep_running(make_engine):
    engine = make_engine(max_model_len=64, num_kv_blocks=4, block_size=16, max_num_seqs=4)
    good = engine.add_request("Hello there", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    with pytest.raises(InvalidRequestError, match="maximum model length") as refused:
        engine.add_request(list(range(100, 164)), SamplingParams(max_tokens=8))
    assert refused.value.param == "prompt"  # no room left for a token
    with pytest.raises(InvalidRequestError, match="maximum model length") as refused:
        engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=32))
    assert refused.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request([1, 2, 10**6], SamplingParams())
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("x", SamplingParams(), request_id=good)
    results = finish_all(engine)
    assert set(results) == {good} and len(results[good].token_ids) == 8
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks


def test_max_model_len_fits_what_the_kv_cache_and_an_unchunked_step_hold(make_engine):
    from conveyor.errors import ConfigError

    # The model's context (8,192) is lowered to what a request alone can have, not advertised.
    assert make_engine(num_kv_blocks=3, block_size=16).max_model_len == 48
    assert make_engine(chunked_prefill=False, max_num_batched_tokens=100).max_model_len == 100
    # One given above it is refused at start, as vLLM refuses it.
    with pytest.raises(ConfigError, match="KV cache holds \\(48\\)"):
        make_engine(max_model_len=64, num_kv_blocks=3, block_size=16)
    with pytest.raises(ConfigError, match="without chunked prefill"):
        make_engine(max_model_len=200, chunked_prefill=False, max_num_batched_tokens=100)


def test_abort_frees_blocks_and_spares_the_others(make_engine):
    engine = make_engine()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    keep = engine.add_request("One two three", params)
    drop = engine.add_request("Four five six", params)
    engine.step()
    engine.step()
    assert engine.abort_request(drop) and not engine.abort_request(drop) and not engine.abort_request("nope")
    results = finish_all(engine)
    assert set(results) == {keep} and len(results[keep].token_ids) == 12
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks


def test_seeded_sampling_is_reproducible_across_batches(make_engine):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    engine = make_engine()
    alone_id = engine.add_request("Tell me a story", params)
    alone = finish_all(engine)[alone_id].token_ids
    engine = make_engine(seed=7)
    for prompt in ("Noise one", "Noise two is longer than the first"):
        engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=1.0))
    batched_id = engine.add_request("Tell me a story", params)
    assert finish_all(engine)[batched_id].token_ids == alone
    other = make_engine()
    other_id = other.add_request("Tell me a story",
                                 SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=43, ignore_eos=True))
    assert finish_all(other)[other_id].token_ids != alone


def test_timestamps_are_ordered(make_engine):
    engine = make_engine()
    rid = engine.add_request("Count: one, two,", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    times = finish_all(engine)[rid].times
    assert times.arrival <= times.first_scheduled <= times.first_token == times.tokens[0]
    assert times.tokens == sorted(times.tokens) and len(times.tokens) == 6 and times.finished == times.tokens[-1]


def test_logprobs_come_with_each_token(make_engine):
    engine = make_engine()
    rid = engine.add_request("The capital of France is",
                             SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True))
    per_token = []
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.request_id == rid and out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
            per_token.extend(zip(out.new_token_ids, out.logprobs))
    assert len(per_token) == 5
    for token, entry in per_token:
        assert len(entry) == 2 and max(entry, key=entry.get) == token  # greedy picks the top one
        assert all(v <= 0.0 for v in entry.values())


@pytest.mark.parametrize("limits", [dict(max_model_len=30), dict(num_kv_blocks=1),
                                    dict(max_num_batched_tokens=8, chunked_prefill=False)],
                         ids=["short context", "one block", "small unchunked budget"])
def test_warm_up_fits_the_engines_own_limits(make_engine, limits) -> None:
    engine = make_engine(**limits).warm_up()  # its requests were 32 + 4 tokens, over each of these limits
    assert not engine.has_unfinished_requests and engine.scheduler.kv.usage().used_blocks == 0


def test_an_engine_that_admits_no_request_says_so_at_warm_up(make_engine) -> None:
    from conveyor.errors import ConfigError

    engine = make_engine(max_model_len=1)
    with pytest.raises(ConfigError, match="admits no request"):
        engine.warm_up()
    assert not engine.has_unfinished_requests and engine.scheduler.kv.usage().used_blocks == 0


def test_chat_renders_the_template_and_names_the_prompt_by_its_text(make_engine):
    engine = make_engine()
    llm, greedy = LLM.from_engine(engine), SamplingParams(max_tokens=6, temperature=0.0)
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    (out,) = llm.chat(conversation, greedy)
    rendered = engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    assert out.prompt == rendered and out.prompt_token_ids == engine.tokenizer.encode_chat(rendered)
    assert out.text == llm.generate(rendered, greedy)[0].text  # SmolLM2 adds no BOS: the same prompt
