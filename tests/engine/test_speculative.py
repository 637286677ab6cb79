"""Speculative decoding on the real models: outputs equal those without it, token for token
(greedy), under every feature that touches a request's tokens or blocks; sampled outputs keep the
model's distribution (a chi-square test) and seeded ones do not change at all."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from conveyor.config import EngineConfig
from conveyor.engine.llm import LLM
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import ModelLoadError
from conveyor.runner.model_runner import LoadedModel, load_model
from conveyor.sampling.params import SamplingParams
from conveyor.structured.spec import GrammarSpec

# Text a model continues by copying: proposals from the prompt are accepted for many tokens.
SOURCE = Path(__file__).read_text()[:700]
COPY = f"Repeat the following text exactly.\n\n{SOURCE}\n\nRepeated:\n{SOURCE[:120]}"
PLAIN = "The three most important inventions of the twentieth century were"
FORCED = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, "adaptive": False}


def load(name: str) -> LoadedModel:
    try:
        return load_model(EngineConfig(model=name, activation_dtype="float32"))
    except ModelLoadError as e:  # the model's PyPI packages are installed by `make install-test`
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def qwen() -> LoadedModel:
    return load("qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    return load("gemma3-270m")


def generate(loaded: LoadedModel, spec: dict | None, prompts: list, params: object,
             **options: object) -> tuple[list[list[int]], LLMEngine]:
    config = EngineConfig.from_kwargs(**{"activation_dtype": "float32", "kv_cache_dtype": "float32", "num_kv_blocks": 256,
                                         "speculative_config": spec, **options})
    engine = LLMEngine.from_config(config, loaded)
    outputs = LLM.from_engine(engine).generate(prompts, params)  # type: ignore[arg-type]
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.block_tables  # every block back
    return [o.token_ids for o in outputs], engine


def assert_unchanged(loaded: LoadedModel, prompts: list, params: object, spec: dict = FORCED,
                     **options: object) -> LLMEngine:
    expected, _ = generate(loaded, None, prompts, params, **options)
    got, engine = generate(loaded, spec, prompts, params, **options)
    assert got == expected
    speculator = engine.speculator
    assert speculator is not None and speculator.num_accepted_tokens > 0  # it did speculate
    return engine


GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


def test_greedy_smollm2(default_model: LoadedModel) -> None:
    assert_unchanged(default_model, [COPY, PLAIN], GREEDY)


def test_greedy_gemma3(gemma: LoadedModel) -> None:
    assert_unchanged(gemma, [COPY, PLAIN], GREEDY)


def test_greedy_qwen_in_fp32_and_int8_with_the_default_config(qwen: LoadedModel) -> None:
    assert_unchanged(qwen, [COPY, PLAIN], GREEDY)
    assert_unchanged(qwen, [COPY], GREEDY, spec={"method": "ngram"}, activation_dtype="int8", kv_cache_dtype="auto")


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 24},  # chunked prefill: proposals that do not fit the budget are dropped
    {"num_kv_blocks": 40, "block_size": 8},  # a tiny pool: preemption, and recompute of verified tokens
    {"enable_prefix_caching": False},
], ids=["chunked-prefill", "tiny-pool", "no-prefix-caching"])
def test_greedy_under_scheduler_pressure(default_model: LoadedModel, options: dict) -> None:
    prompts = [COPY, PLAIN, COPY[:300], "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"]
    engine = assert_unchanged(default_model, prompts, GREEDY, **options)
    if "num_kv_blocks" in options:
        assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_holds_only_verified_tokens(default_model: LoadedModel) -> None:
    # The second prompt extends the first's text and output: it hits blocks the first computed while
    # speculating, which must hold what a plain run writes.
    first, _ = generate(default_model, FORCED, [COPY], GREEDY)
    config = EngineConfig.from_kwargs(activation_dtype="float32", kv_cache_dtype="float32", num_kv_blocks=256,
                                      speculative_config=FORCED)
    engine = LLMEngine.from_config(config, default_model)
    llm = LLM.from_engine(engine)
    prompt_ids = default_model.tokenizer.encode(COPY)
    llm.generate([prompt_ids], GREEDY)
    second = llm.generate([prompt_ids + first[0] + [13]], GREEDY)[0]
    assert second.num_cached_tokens > len(prompt_ids)
    expected, _ = generate(default_model, None, [prompt_ids + first[0] + [13]], GREEDY)
    assert second.token_ids == expected[0]


def test_stops_end_where_they_would(default_model: LoadedModel) -> None:
    plain, _ = generate(default_model, None, [COPY], GREEDY)
    stop_token = plain[0][17]  # a token in the middle of a run of accepted proposals
    assert_unchanged(default_model, [COPY], SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_token]))
    assert_unchanged(default_model, [COPY, PLAIN], SamplingParams(max_tokens=23, temperature=0.0))  # mid-proposal
    text = LLM.from_engine(generate(default_model, None, [COPY], GREEDY)[1]).generate(COPY, GREEDY)[0].text
    stop = text[40:46]
    outputs = {}
    for spec in (None, FORCED):
        config = EngineConfig.from_kwargs(activation_dtype="float32", kv_cache_dtype="float32", num_kv_blocks=256,
                                          speculative_config=spec)
        llm = LLM.from_engine(LLMEngine.from_config(config, default_model))
        outputs[spec is None] = llm.generate(COPY, SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))[0]
    assert outputs[True].text == outputs[False].text == text[:40]
    assert outputs[True].finish_reason == outputs[False].finish_reason == "stop"


def test_single_token_bans_speculate_and_change_nothing(default_model: LoadedModel) -> None:
    # llama.cpp's ignore_eos and logit_bias false ban single tokens, masked in every verified row alike
    plain, _ = generate(default_model, None, [COPY], GREEDY)
    banned_token = plain[0][17]  # in the middle of a run of accepted proposals
    banned = SamplingParams(max_tokens=40, temperature=0.0, bad_words_token_ids=[[banned_token]])
    engine = assert_unchanged(default_model, [COPY], banned)
    got, _ = generate(default_model, FORCED, [COPY], banned)
    assert banned_token not in got[0] and engine.speculator is not None


def test_n_samples_and_seeds_do_not_change(default_model: LoadedModel) -> None:
    seeded = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=11)
    assert_unchanged(default_model, [COPY, PLAIN], seeded)
    again, _ = generate(default_model, FORCED, [COPY, PLAIN], seeded)
    assert again == generate(default_model, FORCED, [COPY, PLAIN], seeded)[0]  # reproducible
    assert_unchanged(default_model, [COPY], SamplingParams(max_tokens=30, temperature=0.0, n=2))


def test_a_json_schema_request_speculates_within_its_grammar(default_model: LoadedModel) -> None:
    schema = {"type": "array", "minItems": 5, "maxItems": 5,
              "items": {"type": "object", "properties": {"fruit": {"type": "string"}, "color": {"type": "string"}},
                        "required": ["fruit", "color"]}}
    prompt = 'Five fruits and their colors as JSON: [{"fruit": "apple", "color": "red"}, '
    constrained = SamplingParams(max_tokens=120, temperature=0.0, structured=GrammarSpec.json_schema(schema))
    assert_unchanged(default_model, [prompt], constrained)
    assert_unchanged(default_model, [prompt, COPY], [constrained, GREEDY])


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """The chi-square test's p-value for an even number of degrees of freedom (closed form)."""
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    half_df = (len(observed) - 1) // 2
    assert (len(observed) - 1) % 2 == 0
    x = statistic / 2
    return math.exp(-x) * sum(x**i / math.factorial(i) for i in range(half_df))


def test_sampled_tokens_keep_the_models_distribution(default_model: LoadedModel) -> None:
    """The second token of many seeded samples, each drawn in a step that verified a proposal for
    it (kept when the sample agrees with it, else replaced), against the model's own top-3
    probabilities (temperature 1, top_k 3: 2 degrees of freedom). A third token leaves room for the
    proposal (none is made for a request's last token)."""
    prompt = "one two three one two three one two three one two"
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=seed) for seed in range(400)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    outputs, engine = generate(default_model, spec, [prompt] * len(params), params, max_num_seqs=64,
                               num_kv_blocks=1024)
    assert engine.speculator is not None and engine.speculator.num_drafts >= 300
    first = Counter(o[0] for o in outputs).most_common(1)[0][0]
    seconds = Counter(o[1] for o in outputs if o[0] == first)
    prompt_ids = default_model.tokenizer.encode(prompt) + [first]
    engine = LLMEngine.from_config(EngineConfig.from_kwargs(activation_dtype="float32", kv_cache_dtype="float32"),
                                   default_model)
    top = LLM.from_engine(engine).generate([prompt_ids], SamplingParams(max_tokens=1, logprobs=3))[0].logprobs
    assert top is not None
    logprobs = sorted(top[0].items(), key=lambda kv: -kv[1])[:3]
    mass = sum(math.exp(lp) for _, lp in logprobs)
    n = sum(seconds.values())
    assert n >= 100 and set(seconds) <= {t for t, _ in logprobs}
    expected = [n * math.exp(lp) / mass for _, lp in logprobs]
    observed = [seconds.get(t, 0) for t, _ in logprobs]
    assert chi_square_p_value(observed, expected) > 0.001, (observed, expected)
