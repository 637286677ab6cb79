"""Prompt lookup, the step cost model, the depth rule and the configuration (pure Python)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.config import EngineConfig, SpeculativeConfig
from conveyor.errors import ConfigError
from conveyor.request import Request, RequestStatus
from conveyor.sampling.params import SamplingParams
from conveyor.speculative import NgramProposer, Speculator, StepCostModel, can_speculate


def request(prompt: list[int], output: list[int] = (), **params: object) -> Request:  # type: ignore[assignment]
    r = Request("r", list(prompt), SamplingParams(max_tokens=100, **params), 0.0)
    r.output_token_ids = list(output)
    r.status = RequestStatus.RUNNING
    r.num_computed_tokens = r.num_tokens - 1
    return r


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix (max_n down to min_n) found earlier, at its latest occurrence."""
    end = len(tokens)
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):  # occurrences ending before the suffix's end
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_lookup_takes_the_longest_suffix_at_its_latest_occurrence() -> None:
    proposer = NgramProposer(1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    # Suffix [1, 2, 3] occurred at 0 (followed by 9, 2, 3); [2, 3] occurred later, but is shorter.
    assert proposer.propose_one(request(tokens), 3) == [9, 2, 3]
    assert proposer.propose_one(request([5, 6, 7, 5, 6]), 4) == [7, 5, 6]  # may run into the suffix itself
    assert proposer.propose_one(request([4, 4]), 2) == [4]
    assert proposer.propose_one(request([1, 2, 3]), 5) == []  # nothing repeats
    assert proposer.propose_one(request([1, 2, 1, 2]), 0) == []


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60), cuts=st.lists(st.integers(1, 60), max_size=5),
       min_n=st.integers(1, 3), extra=st.integers(0, 3), k=st.integers(1, 6))
def test_the_incremental_index_equals_a_search_of_the_whole_sequence(
        tokens: list[int], cuts: list[int], min_n: int, extra: int, k: int) -> None:
    proposer = NgramProposer(min_n, min_n + extra)
    r = request(tokens[:1])
    for cut in sorted(set(cuts)) + [len(tokens)]:  # the output grows in chunks between lookups
        r.output_token_ids = tokens[1:max(1, cut)]
        seq = r.prompt_token_ids + r.output_token_ids
        assert proposer.propose_one(r, k) == brute_force(seq, min_n, min_n + extra, k)


def test_the_cost_model_tells_sampled_rows_from_prefill_rows() -> None:
    model = StepCostModel()
    assert model.fit() is None
    for _ in range(3):
        model.observe(1, 1, 0.0195)
    assert model.fit() is None  # one size seen: no slope yet
    # base 18 ms, 1 ms a row, 0.5 ms more a sampled row: prefills (few sampled), decodes, verifies.
    for rows, sampled in [(512, 1), (4, 4), (16, 16), (300, 8), (40, 30), (64, 64), (1, 1), (128, 2)]:
        model.observe(rows, sampled, 0.018 + 0.001 * rows + 0.0005 * sampled)
    fit = model.fit()
    assert fit is not None and fit == pytest.approx((0.018, 0.001, 0.0005), rel=1e-3, abs=1e-6)
    assert model.per_proposal == pytest.approx(0.0015, rel=1e-3)
    assert model.step_time(10, 10) == pytest.approx(0.018 + 0.015, rel=1e-3)


def test_decodes_alone_still_price_a_proposal() -> None:
    model = StepCostModel()  # every step samples every row: the slopes cannot be told apart, their sum can
    for rows in [1, 2, 4, 8, 16, 32, 64]:
        model.observe(rows, rows, 0.018 + 0.0015 * rows)
    assert model.per_proposal == pytest.approx(0.0015, rel=1e-3)
    assert model.step_time(10, 10) == pytest.approx(0.033, rel=1e-3)


def speculator_at(per_row: float, base: float, **config: object) -> Speculator:
    speculator = Speculator(SpeculativeConfig(**config))  # type: ignore[arg-type]
    for rows in [1, 2, 4, 8, 16, 32, 64]:
        speculator.observe_step(rows, rows, base + per_row * rows)
    return speculator


def test_depth_is_deep_for_one_stream_and_shallow_for_a_full_batch_of_poor_proposals() -> None:
    speculator = speculator_at(0.0015, 0.018, num_speculative_tokens=8)
    one, other = request([1, 2, 3], [4]), request([1, 2, 3], [4])
    # The prior rate, 0.5: 0.5**3 * 19.5 ms >= 1.5 ms > 0.5**4 * 19.5 ms.
    assert speculator.depth(one, rows=1, tokens=1) == 3
    for _ in range(10):  # a request whose proposals fail at the first token
        speculator.observe_verified(other, 4, 0)
    assert speculator.depth(other, rows=32, tokens=32) == 0
    for _ in range(10):  # and one whose proposals all hold
        speculator.observe_verified(one, 4, 4)
    assert speculator.depth(one, rows=32, tokens=32) == 8
    assert Speculator(SpeculativeConfig(num_speculative_tokens=3, adaptive=False)).depth(other, 32, 32) == 3


def test_depth_follows_the_rule() -> None:
    speculator = speculator_at(0.002, 0.020, num_speculative_tokens=24)
    r = request([1], [2])
    for _ in range(30):
        speculator.observe_verified(r, 10, 8)  # rate 8 / (8 + 1)
    rate = 8 / 9
    token_value = (0.020 + 0.002 * 4) / 4  # a step of 4 decode rows yields 4 tokens
    depth = speculator.depth(r, rows=4, tokens=4)
    assert rate ** depth * token_value >= 0.002 > rate ** (depth + 1) * token_value or depth == 24


def test_who_may_speculate() -> None:
    assert can_speculate(request([1, 2], [3]))
    assert not can_speculate(request([1, 2]))  # no output yet: still prefilling
    assert not can_speculate(request([1, 2], [3], logprobs=2))
    assert not can_speculate(request([1, 2], [3], repetition_penalty=1.2))
    assert not can_speculate(request([1, 2], [3], min_tokens=5))
    assert not can_speculate(request([1, 2], [3], bad_words_token_ids=[[4, 5]]))  # depends on the output so far
    assert can_speculate(request([1, 2], [3], bad_words_token_ids=[[4], [6]]))  # banned in every row alike
    assert can_speculate(request([1, 2], [3], temperature=0.7, seed=1, top_k=5))
    prefilling = request([1, 2, 3], [4])
    prefilling.num_computed_tokens = 1
    assert not can_speculate(prefilling)


def test_speculative_config_parses_like_vllms() -> None:
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}').num_speculative_tokens == 4
    assert SpeculativeConfig.parse({"prompt_lookup_max": 6}).prompt_lookup_max == 6
    assert EngineConfig(speculative_config={"method": "ngram"}).speculative_config == SpeculativeConfig()  # type: ignore[arg-type]
    for bad, field in [('{"method": "eagle"}', "method"), ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                       ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
                       ('{"nope": 1}', "nope"), ("[1]", "JSON object"), ("{", "not valid JSON"),
                       ('{"adaptive": "yes"}', "adaptive")]:
        with pytest.raises(ConfigError, match=field):
            SpeculativeConfig.parse(bad)
