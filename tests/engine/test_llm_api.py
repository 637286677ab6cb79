"""LLM's offline API in the shapes vLLM's takes and gives, on the real default model: one output
per prompt with its n samples, logprobs over the whole output, dict prompts, a refused prompt
withdrawing the batch, chat's options."""
from __future__ import annotations

import pytest

from conveyor.engine.llm import LLM
from conveyor.errors import InvalidRequestError
from conveyor.sampling import SamplingParams


@pytest.fixture()
def llm(make_engine) -> LLM:
    return LLM.from_engine(make_engine())


def test_n_samples_come_back_together_in_outputs(llm: LLM) -> None:
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    first, second = llm.generate(["Once upon a time", "The capital of France is"], params)
    for out in (first, second):
        assert [o.index for o in out.outputs] == [0, 1, 2] and out.index == 0
        assert out.text == out.outputs[0].text and out.token_ids == out.outputs[0].token_ids
        assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in out.outputs)
        assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # independent samples
    assert first.outputs[1].text == llm.tokenizer.decode(first.outputs[1].token_ids)


def test_logprobs_cover_every_token_and_the_prompt(llm: LLM) -> None:
    ids = llm.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": ids}, params)
    assert len(out.logprobs) == len(out.token_ids) == 5
    assert all(token in step and len(step) <= 3 for step, token in zip(out.logprobs, out.token_ids))
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(s[t] for s, t in zip(out.logprobs, out.token_ids)))
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    (plain,) = llm.generate(ids, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert plain.token_ids == out.token_ids and plain.outputs[0].cumulative_logprob is None


def test_logprobs_are_vllms_logprob_objects_and_still_floats(llm: LLM) -> None:
    import pickle

    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    (out,) = llm.generate("The capital of France is", params)
    for step, token in zip(out.outputs[0].logprobs, out.token_ids):
        chosen = step[token]
        assert chosen.logprob == float(chosen) and chosen + 0.0 == chosen.logprob  # vLLM's field, and a float
        assert chosen.rank == 1  # greedy: the likeliest
        assert chosen.decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)
        by_rank = sorted(step.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in by_rank] == [1, 2, 3]
        assert [lp.logprob for lp in by_rank] == sorted((lp.logprob for lp in by_rank), reverse=True)
    assert out.logprobs == out.outputs[0].logprobs
    first = out.prompt_logprobs[1]
    own = first[out.prompt_token_ids[1]]
    assert own.decoded_token is not None and len(first) in (2, 3)
    alternatives = {t: lp for t, lp in first.items() if t != out.prompt_token_ids[1] or len(first) == 2}
    assert sorted(lp.rank for lp in alternatives.values()) == [1, 2]
    assert own.rank is not None and (own.rank > 2) == (len(first) == 3)  # below them: its place in the vocabulary
    def fields(steps):  # == on a Logprob compares the number only
        return [{t: (float(lp), lp.rank, lp.decoded_token) for t, lp in step.items()} for step in steps]

    assert fields(pickle.loads(pickle.dumps(out.outputs[0].logprobs))) == fields(out.outputs[0].logprobs)
    assert str(chosen) == repr(float(chosen)) and f"{chosen:.2f}" == f"{float(chosen):.2f}"  # prints as the number


def test_a_sampled_token_below_the_top_alternatives_has_its_place_in_the_vocabulary() -> None:
    from conveyor.engine.outputs import ranked_logprobs
    from conveyor.sampling.outputs import TokenLogprobs

    ranked = ranked_logprobs(TokenLogprobs({7: -3.0, 1: -0.1, 2: -1.0}, 9), 7, 2, str)  # 7 drawn, 9th likeliest
    assert (ranked[1].rank, ranked[2].rank, ranked[7].rank) == (1, 2, 9)
    assert ranked[7].decoded_token == "7" and ranked[7] == -3.0
    assert ranked_logprobs(TokenLogprobs({5: -0.2, 6: -2.0}, 1), 5, 2, str)[5].rank == 1  # drawn among them
    tied = ranked_logprobs(TokenLogprobs({7: -1.0, 1: -0.1, 2: -1.0}, 3), 7, 2, str)  # tied with the 2nd
    assert (tied[1].rank, tied[2].rank, tied[7].rank) == (1, 2, 3)
    assert ranked_logprobs(TokenLogprobs({4: -0.5}, 12), 4, 0, str)[4].rank == 12  # logprobs=0: its place alone
    assert ranked_logprobs({4: -0.5}, 4, 0, str)[4].rank is None  # a step without the sampler's count


def test_the_rank_of_a_token_outside_the_top_alternatives_is_its_place_in_the_model_distribution(llm: LLM) -> None:
    """Prompt tokens scored with 20 alternatives (ranked by order) and with none (ranked by the
    sampler's count over the vocabulary) agree, inside the 20 and past them."""
    ids = llm.tokenizer.encode("The capital of France is Paris, and the capital of Peru is a llama.")
    (wide,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=20))
    (alone,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))
    ranks = [step[token].rank for step, token in zip(alone.prompt_logprobs[1:], ids[1:])]
    within = [(rank, step[token].rank) for rank, step, token in zip(ranks, wide.prompt_logprobs[1:], ids[1:])
              if len(step) == 20]  # the token is one of the 20
    assert within and all(counted == ordered for counted, ordered in within)
    past = [rank for rank, step in zip(ranks, wide.prompt_logprobs[1:]) if len(step) == 21]
    assert past and all(rank > 20 for rank in past)
    (drawn,) = llm.generate("Once upon a time", SamplingParams(max_tokens=16, temperature=2.0, seed=3, logprobs=0))
    assert all(step[token].rank >= 1 for step, token in zip(drawn.logprobs, drawn.token_ids))
    assert any(step[token].rank > 1 for step, token in zip(drawn.logprobs, drawn.token_ids))  # hot: not all likeliest


def test_vllms_dict_prompts_and_argument_types(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    text = llm.generate("Hello", greedy)[0].text
    ids = llm.tokenizer.encode("Hello")
    assert [o.text for o in llm.generate([{"prompt": "Hello"}, {"prompt_token_ids": ids}], greedy)] == [text, text]
    assert llm.generate({"prompt": "Hello"}, greedy, use_tqdm=True)[0].text == text
    with pytest.raises(TypeError, match="a dict prompt is"):
        llm.generate({"prompt": "Hello", "multi_modal_data": {}}, greedy)
    with pytest.raises(TypeError, match="sampling_params takes a SamplingParams"):
        llm.generate("Hello", {"max_tokens": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LoRA"):
        llm.generate("Hello", greedy, lora_request=object())  # type: ignore[arg-type]
    assert llm.get_tokenizer() is llm.tokenizer and llm.llm_engine is llm.engine


def test_a_refused_prompt_withdraws_the_batch_and_leaves_the_llm_usable(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate(["Hello", [10**9], "World"], greedy)
    assert "prompts[1] was refused" in "".join(getattr(refused.value, "__notes__", []))
    engine = llm.engine
    assert not engine.has_unfinished_requests and engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks
    assert llm.generate(["Hello", "World"], greedy)[1].text == llm.generate("World", greedy)[0].text


def test_sampling_params_take_none_for_empty_lists_and_check_flags() -> None:
    params = SamplingParams(stop=None, stop_token_ids=None)  # type: ignore[arg-type]
    assert params.stop == [] and params.stop_token_ids == []
    with pytest.raises(InvalidRequestError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output="yes")  # type: ignore[arg-type]


def test_chat_takes_vllms_options(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    joined = [{"role": "user", "content": "What is 2+2?"}]
    assert llm.chat(messages=parts, sampling_params=greedy)[0].text == llm.chat(joined, greedy)[0].text
    template = "{% for m in messages %}Q: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    (custom,) = llm.chat(joined, greedy, chat_template=template)
    assert custom.prompt == "Q: What is 2+2?\nA:"
    (opened,) = llm.chat([*joined, {"role": "assistant", "content": "The answer"}], greedy,
                         add_generation_prompt=False, continue_final_message=True)
    assert opened.prompt.endswith("The answer")
    with pytest.raises(InvalidRequestError, match="does not read"):
        llm.chat(joined, greedy, chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(InvalidRequestError, match="encode_messages"):
        llm.tokenizer.apply_chat_template(joined, tokenize=True)
    assert llm.get_tokenizer().apply_chat_template(joined, tokenize=False) == llm.chat(joined, greedy)[0].prompt
    # chat_template_kwargs override chat's own options, as vLLM's do
    (kwarg,) = llm.chat(joined, greedy, chat_template=template, chat_template_kwargs={"add_generation_prompt": False})
    assert kwarg.prompt == "Q: What is 2+2?\n"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(InvalidRequestError, match="renders them"):  # SmolLM2's template shows no tools
        llm.chat(joined, greedy, tools=tools)
    shows_tools = "{{ tools | tojson }}" + template
    assert llm.chat(joined, greedy, chat_template=shows_tools, tools=tools)[0].prompt.startswith('[{"type"')
    with pytest.raises(InvalidRequestError, match="only text content"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy)


@pytest.mark.parametrize("options, message", [
    ({"max_num_seqs": "8"}, "max_num_seqs must be int, got '8'"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be bool"),
    ({"block_size": 0.5}, "block_size must be int"),
    ({"gpu_memory_utilization": 0.9}, "size the KV pool with kv_cache_memory"),
    ({"dtype": "half"}, "dtype must be"),
])
def test_engine_options_of_the_wrong_kind_are_refused_by_name(options: dict, message: str) -> None:
    from conveyor.config import EngineConfig
    from conveyor.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_kwargs(**options)


def test_vllms_spellings_of_the_default_are_taken() -> None:
    from conveyor.config import EngineConfig

    config = EngineConfig.from_kwargs(dtype="auto", seed=None)
    assert (config.dtype, config.seed) == (EngineConfig.dtype, EngineConfig.seed)


def test_a_request_the_engine_fails_ends_all_its_samples_and_spares_the_batch(make_engine, monkeypatch) -> None:
    from conveyor.errors import RequestFailedError
    from tests.engine.test_failure_isolation import _poison_after

    engine = make_engine()
    llm = LLM.from_engine(engine)
    poison = engine.tokenizer.encode("Zebra")[0]
    _poison_after(monkeypatch, engine.runner.sampler, "_uniforms",
                  lambda requests: any(r.prompt_token_ids[0] == poison for r in requests))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    sampled = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1)
    good, failed = llm.generate(["Hello", "Zebra crossings are"], [greedy, sampled])
    assert good.finish_reason == "length" and good.text == llm.generate("Hello", greedy)[0].text
    assert [o.index for o in failed.outputs] == [0, 1, 2]
    assert all(o.finish_reason == "error" for o in failed.outputs) and isinstance(failed.error, RequestFailedError)
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks


def test_numpy_numbers_and_paths_are_taken_as_what_they_hold(tmp_path) -> None:
    import numpy as np

    from conveyor.config import EngineConfig

    config = EngineConfig.from_kwargs(model=tmp_path / "m.gguf", max_num_seqs=np.int64(8), seed=np.int64(3),
                                      tensor_parallel_size=1)
    assert (config.model, config.scheduler.max_num_seqs, config.seed) == (str(tmp_path / "m.gguf"), 8, 3)
    assert type(config.seed) is int


def test_without_sampling_params_the_model_recommendation_applies(make_engine, tmp_path) -> None:
    # vLLM's --generation-config: a folder's generation_config.json (here: greedy, 5 tokens, a penalty)
    (tmp_path / "generation_config.json").write_text(
        '{"do_sample": false, "temperature": 0.0, "max_new_tokens": 5, "repetition_penalty": 1.3, "top_k": 50}')
    llm = LLM.from_engine(make_engine(generation_config=str(tmp_path)))
    defaults = llm.get_default_sampling_params()
    # top_k 50 is transformers' own default, not a recommendation (vLLM leaves it out too)
    assert (defaults.temperature, defaults.max_tokens, defaults.repetition_penalty, defaults.top_k) == (0.0, 5, 1.3, 0)
    prompt = "The capital of France is"
    (recommended,) = llm.generate(prompt)
    (explicit,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, repetition_penalty=1.3))
    (plain,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5))
    assert recommended.token_ids == explicit.token_ids and len(recommended.token_ids) == 5
    assert plain.token_ids != explicit.token_ids  # the penalty changes this output: it was applied
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}])
    assert len(chat.token_ids) <= 5
    # A recommended max_tokens is at most the room a prompt leaves (the caller never asked for it)
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 100000}')
    (long,) = LLM.from_engine(make_engine(generation_config=tmp_path, max_model_len=40)).generate(
        [1] * 30 + [2] * 5)
    assert len(long.token_ids) <= 5 and long.finish_reason in ("length", "stop")


def test_the_models_own_recommendation_and_vllm_turning_it_off(make_engine, monkeypatch) -> None:
    engine = make_engine()
    # as a GGUF's general.sampling.* keys or an HF folder's generation_config.json would have it
    monkeypatch.setattr(engine.tokenizer, "recommended_sampling", {"temperature": 0.5, "top_p": 0.9})
    auto = LLM.from_engine(engine).get_default_sampling_params()
    assert (auto.temperature, auto.top_p, auto.max_tokens) == (0.5, 0.9, 16)
    off = LLM.from_engine(make_engine(generation_config="vllm")).get_default_sampling_params()
    assert off == SamplingParams()
