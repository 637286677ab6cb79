from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.errors import InvalidRequestError
from conveyor.request import Request
from conveyor.sampling import SamplingParams
from conveyor.sampling.sampler import (FIRST_CANDIDATE_WIDTH, Sampler, adjust_logits, check_generator_state,
                                       nucleus_candidates)

NEG_INF = float("-inf")


def requests(*params: SamplingParams) -> list[Request]:
    return [Request(str(i), [1], p, 0.0) for i, p in enumerate(params)]


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def test_greedy_is_argmax():
    logits = randn(5, 100)
    assert Sampler()(logits, requests(*[SamplingParams(temperature=0.0)] * 5)).tokens == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_index_of_the_maximum_and_nan_first():
    logits = np.zeros((3, 10), dtype=np.float32)
    logits[0, [3, 7]] = 2.0
    logits[1, [2, 8]] = np.nan
    logits[1, 5] = np.inf
    logits[2, :] = NEG_INF
    assert Sampler()(logits, requests(*[SamplingParams(temperature=0.0)] * 3)).tokens == [3, 2, 0]


def test_top_k_one_is_greedy_at_any_temperature():
    logits = randn(6, 100)
    out = Sampler()(logits, requests(*[SamplingParams(temperature=1.5, top_k=1)] * 6)).tokens
    assert out == logits.argmax(-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = randn(4, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams()]
    out = Sampler()(logits, requests(*params)).tokens
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())


def test_seeded_request_is_reproducible_whatever_its_batch():
    row = randn(1000)

    def draw(batch_before: int, batch_after: int) -> list[int]:
        target = Request("t", [1], SamplingParams(temperature=1.0, seed=1234), 0.0)
        others = requests(*[SamplingParams(temperature=1.0)] * (batch_before + batch_after))
        sampler, tokens = Sampler(seed=batch_before * 7 + 1), []
        for step in range(20):
            batch = others[:batch_before] + [target] + others[batch_before:]
            logits = randn(len(batch), 1000, seed=1000 * batch_before + step + 1)
            logits[batch_before] = row
            tokens.append(sampler(logits, batch).tokens[batch_before])
        return tokens

    assert draw(0, 0) == draw(3, 5) == draw(7, 0)
    assert len(set(draw(0, 0))) > 10, "a seeded request still draws"


def test_a_seeds_draws_are_the_same_in_a_new_sampler_and_differ_between_seeds():
    logits = randn(1, 5000, scale=0.2)

    def draws(seed: int, sampler_seed: int) -> list[int]:
        sampler, request = Sampler(seed=sampler_seed), requests(SamplingParams(temperature=1.0, seed=seed))
        return [sampler(logits, request).tokens[0] for _ in range(10)]

    assert draws(5, 0) == draws(5, 1) != draws(6, 0)
    assert draws(-3, 0) == draws(-3, 2) != draws(3, 0), "a negative seed is a seed of its own"


def test_unseeded_draws_follow_the_samplers_seed():
    logits = randn(4, 5000, scale=0.2)
    params = requests(*[SamplingParams(temperature=1.0)] * 4)
    assert Sampler(seed=1)(logits, params).tokens == Sampler(seed=1)(logits, params).tokens
    assert Sampler(seed=1)(logits, params).tokens != Sampler(seed=2)(logits, params).tokens


def test_temperature_sampling_follows_softmax():
    logits = np.tile(np.array([[2.0, 1.0, 0.0, -1.0]], dtype=np.float32), (20000, 1))
    out = np.array(Sampler(seed=3)(logits, requests(*[SamplingParams(temperature=0.5)] * 20000)).tokens)
    freq = np.bincount(out, minlength=4) / len(out)
    expected = softmax64(logits[0] / 0.5)
    assert np.allclose(freq, expected, atol=0.015), (freq, expected)


def test_top_k_and_top_p_restrict_support():
    logits = np.tile(np.array([[3.0, 2.9, 2.8, 0.0, -1.0, -2.0]], dtype=np.float32), (3000, 1))
    top_k = Sampler(seed=1)(logits, requests(*[SamplingParams(temperature=1.0, top_k=2)] * 3000)).tokens
    assert set(top_k) == {0, 1}
    # probs ~ [.33, .30, .27, .02, ...]: top_p 0.6 keeps the first two (mass before token 2 is .63).
    top_p = Sampler(seed=2)(logits, requests(*[SamplingParams(temperature=1.0, top_p=0.6)] * 3000)).tokens
    assert set(top_p) == {0, 1}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=0),
        dict(max_tokens=-3),
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(max_tokens="12"),
        dict(temperature="hot"),
        dict(seed=1.5),
        dict(stop=[""]),
        dict(stop_token_ids=[-1]),
        dict(ignore_eos="yes"),
        dict(seed=2**64),
        dict(seed=2**63 - 1, n=2),
        dict(n=0),
        dict(logprobs=21),
        dict(prompt_logprobs=-1),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(repetition_penalty=0.0),
        dict(repetition_penalty=2.5),
        dict(min_p=1.5),
        dict(min_tokens=-1),
        dict(min_tokens=5, max_tokens=3),
        dict(logit_bias={5: 101.0}),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias={"5": 1.0}),
        dict(skip_special_tokens="no"),
        dict(allowed_token_ids=[]),
        dict(allowed_token_ids=[3, -1]),
        dict(allowed_token_ids=5),
        dict(bad_words=["ok", " "]),
        dict(bad_words=["w"] * 129),
        dict(bad_words=["w" * 70_000]),
        dict(allowed_token_ids=[1] * (2**18 + 1)),
        dict(bad_words_token_ids=[[]]),
        dict(bad_words_token_ids=[[1] * 1025]),
        dict(cache_salt=""),
        dict(cache_salt=3),
    ],
)
def test_bad_sampling_params_raise_typed_error(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_logprobs_report_chosen_and_top_alternatives():
    logits = randn(3, 40)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, logprobs=0)]
    out = Sampler(seed=5)(logits, requests(*params))
    assert out.logprobs is not None and out.logprobs[1] is None
    expected = log_softmax64(logits)
    top3 = np.argsort(-expected[0], kind="stable")[:3].tolist()
    assert list(out.logprobs[0]) == top3  # greedy: the chosen token is the top one
    for token, value in out.logprobs[0].items():
        assert abs(value - float(expected[0, token])) < 1e-5
    assert list(out.logprobs[2]) == [out.tokens[2]]
    assert Sampler()(logits, requests(SamplingParams())).logprobs is None


def test_top_logprobs_of_tied_tokens_come_in_token_order():
    logits = np.zeros((1, 300), dtype=np.float32)
    logits[0, [250, 40, 7, 120]] = [3.0, 1.0, 1.0, 1.0]
    out = Sampler()(logits, requests(SamplingParams(temperature=0.0, logprobs=3)))
    assert list(out.logprobs[0]) == [250, 7, 40]
    assert out.logprobs[0].rank == 1


# --- logit adjustments: each checked against its definition, computed the slow way -------------
def reference_adjusted(logits: np.ndarray, request: Request, eos: tuple[int, ...] = ()) -> np.ndarray:
    """vLLM's order, one token at a time, in float64: allowed_token_ids, bad words, min_tokens,
    logit_bias, repetition, frequency, presence."""
    p, out = request.sampling_params, np.array(logits, dtype=np.float64)
    if p.allowed_token_ids is not None:
        for t in range(len(out)):
            if t not in p.allowed_token_ids:
                out[t] = float("-inf")
    output = request.output_token_ids
    for word in p.bad_words_token_ids:
        *head, last = word
        if len(head) <= len(output) and output[len(output) - len(head):] == head:
            out[last] = float("-inf")
    if len(request.output_token_ids) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            out[t] = float("-inf")
    for t, b in p.logit_bias.items():
        out[t] += b
    seen = set(request.prompt_token_ids) | set(request.output_token_ids)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = request.output_token_ids.count(t)
        out[t] -= count * p.frequency_penalty + (count > 0) * p.presence_penalty
    return out


def made_request(rid: str, prompt: list[int], output: list[int], params: SamplingParams) -> Request:
    request = Request(rid, prompt, params, 0.0)
    request.output_token_ids = list(output)
    return request


def test_penalties_bias_and_min_tokens_follow_their_definitions():
    vocab = 30
    logits = randn(6, vocab, scale=3)
    reqs = [
        made_request("plain", [1, 2], [3, 3], SamplingParams(temperature=0.0)),
        made_request("freq", [1, 2], [3, 3, 3, 7], SamplingParams(frequency_penalty=0.7)),
        made_request("pres", [4], [5, 5, 9], SamplingParams(presence_penalty=-1.3)),
        made_request("rep", [0, 1, 2, 11], [12, 12, 20], SamplingParams(repetition_penalty=1.8)),
        made_request("all", [8, 8, 6], [6, 10, 10, 10], SamplingParams(
            repetition_penalty=0.6, frequency_penalty=0.4, presence_penalty=0.5, logit_bias={10: 5.0, 2: -100.0})),
        made_request("min", [1], [2], SamplingParams(min_tokens=3, stop_token_ids=[4], logit_bias={0: 2.0})),
    ]
    adjusted = adjust_logits(logits, reqs, eos_token_ids=(0,))
    for i, request in enumerate(reqs):
        expected = reference_adjusted(logits[i], request, eos=(0,))
        assert np.allclose(adjusted[i], expected, atol=1e-5, rtol=0), request.request_id
    assert np.array_equal(adjusted[0], logits[0])  # a row without adjustments is untouched
    assert adjusted[5, 0] == float("-inf") and adjusted[5, 4] == float("-inf")
    # The chosen token under greedy sampling is the argmax of the adjusted row, not of the model's.
    greedy = [SamplingParams(temperature=0.0, **kw) for kw in ({}, {"logit_bias": {int(logits[1].argmin()): 100.0}})]
    tokens = Sampler()(logits[:2], [made_request(str(i), [1], [], p) for i, p in enumerate(greedy)]).tokens
    assert tokens == [int(logits[0].argmax()), int(logits[1].argmin())]


def test_allowed_tokens_and_bad_words_follow_their_definitions():
    vocab = 30
    logits = randn(5, vocab, seed=1, scale=3)
    words = [[4], [7, 8, 9], [2, 3]]
    reqs = [
        made_request("allowed", [1], [2], SamplingParams(allowed_token_ids=[3, 5, 29, 99], logit_bias={6: 100.0})),
        made_request("bad, prefix matches", [1], [5, 7, 8], SamplingParams(bad_words_token_ids=words)),
        made_request("bad, prefix does not", [1], [7, 5, 8], SamplingParams(bad_words_token_ids=words)),
        made_request("bad, longer than the output", [7, 8], [], SamplingParams(bad_words_token_ids=[[7, 8, 9]])),
        made_request("both", [1], [2], SamplingParams(allowed_token_ids=[3, 4], bad_words_token_ids=words,
                                                      min_tokens=2, stop_token_ids=[3])),
    ]
    adjusted = adjust_logits(logits, reqs)
    for i, request in enumerate(reqs):
        assert np.array_equal(adjusted[i], reference_adjusted(logits[i], request)), request.request_id
    assert set(np.flatnonzero(np.isfinite(adjusted[0])).tolist()) == {3, 5, 29}, "a bias cannot reopen a token"
    assert adjusted[1, 9] == adjusted[1, 4] == NEG_INF and adjusted[1, 3] == logits[1, 3]
    assert adjusted[2, 9] == logits[2, 9] and adjusted[3, 9] == logits[3, 9], "the output is what counts"
    assert bool(np.isinf(adjusted[4]).all()), "nothing allowed is left: every token is masked"
    sampler = Sampler(seed=3)
    tokens = sampler(logits[:2], reqs[:2]).tokens
    assert tokens[0] in (3, 5, 29) and tokens[1] not in (4, 9)
    mask = sampler._allowed_masks[reqs[0]]
    assert sampler(logits[:1] * 2, reqs[:1]).tokens[0] in (3, 5, 29)
    assert sampler._allowed_masks[reqs[0]] is mask, "the allowed-token mask is made once per request"


def test_bad_words_tokenize_as_they_start_a_text_and_after_a_space():
    vocab = {"cat": [10], " cat": [11], "hot dog": [12, 13], " hot dog": [14, 13], "ab": [1, 2], " ab": [3, 4, 5]}
    params = SamplingParams(bad_words=["cat", " hot dog", "ab"], bad_words_token_ids=[[7]])
    tokenized = params.with_bad_words_tokenized(vocab.__getitem__)
    # " ab" takes more tokens than "ab": not a variant of the same word, so left out (as vLLM).
    assert tokenized.bad_words_token_ids == [[7], [10], [11], [12, 13], [14, 13], [1, 2]]
    assert tokenized.with_bad_words_tokenized(vocab.__getitem__) == tokenized, "applying it again adds nothing"


def test_adjustments_leave_the_callers_logits_and_logprobs_alone():
    logits = randn(2, 20)
    before = logits.copy()
    params = SamplingParams(temperature=0.0, logprobs=2, frequency_penalty=2.0, logit_bias={3: 50.0})
    out = Sampler()(logits, [made_request("a", [1], [5, 5], params), made_request("b", [1], [], SamplingParams())])
    assert np.array_equal(logits, before) and out.tokens[0] == 3
    assert abs(out.logprobs[0][3] - float(log_softmax64(before[0])[3])) < 1e-6  # the model's own


def test_a_strided_view_of_the_logits_samples_as_its_copy():
    logits = randn(40, 6, scale=2).T  # rows 40 apart: the runner may hand a view
    params = [SamplingParams(temperature=0.0, logit_bias={3: 1.0}), SamplingParams(temperature=0.9, seed=4, top_p=0.9),
              SamplingParams(temperature=0.9, seed=5), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.7, seed=6, sampler_chain=("top_k", "temperature"), top_k=5),
              SamplingParams(temperature=1.0, seed=7, repetition_penalty=1.3)]
    assert not logits.flags.c_contiguous
    strided, contiguous = Sampler()(logits, requests(*params)), Sampler()(logits.copy(), requests(*params))
    assert strided.tokens == contiguous.tokens and strided.logprobs == contiguous.logprobs


def test_penalized_sampling_follows_the_adjusted_softmax():
    n = 20000
    logits = np.tile(np.array([[2.0, 1.5, 1.0, 0.5]], dtype=np.float32), (n, 1))
    params = SamplingParams(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.5,
                            logit_bias={3: 1.0})
    reqs = [made_request(str(i), [2], [0, 0, 1], params) for i in range(n)]
    tokens = np.array(Sampler(seed=4)(logits, reqs).tokens)
    freq = np.bincount(tokens, minlength=4) / n
    expected = softmax64(reference_adjusted(logits[0], reqs[0]) / 0.8)
    assert np.allclose(freq, expected, atol=0.015), (freq, expected)


def test_min_p_drops_tokens_below_its_share_of_the_top():
    logits = np.tile(np.log(np.array([[0.5, 0.3, 0.12, 0.08]], dtype=np.float32)), (4000, 1))
    reqs = [made_request(str(i), [1], [], SamplingParams(temperature=1.0, min_p=0.2)) for i in range(4000)]
    tokens = Sampler(seed=9)(logits, reqs).tokens
    assert set(tokens) == {0, 1, 2}  # 0.08 < 0.2 * 0.5 is dropped, 0.12 is kept
    freq = np.bincount(np.array(tokens), minlength=4) / len(tokens)
    assert np.allclose(freq, np.array([0.5, 0.3, 0.12, 0.0]) / 0.92, atol=0.025), freq


def test_penalized_seeded_request_is_invariant_to_its_batch():
    row = randn(200, seed=1)
    params = SamplingParams(temperature=1.0, seed=77, frequency_penalty=1.0, repetition_penalty=1.3)

    def draw(before: int) -> list[int]:
        target = made_request("t", [5, 6], [], params)
        others = [made_request(f"o{i}", [1], [], SamplingParams(presence_penalty=0.5)) for i in range(before)]
        sampler, tokens = Sampler(seed=before), []
        for step in range(12):
            batch = others + [target]
            logits = randn(len(batch), 200, seed=100 * before + step + 2)
            logits[before] = row
            token = sampler(logits, batch).tokens[before]
            tokens.append(token)
            target.output_token_ids.append(token)
            for o in others:
                o.output_token_ids.append(0)
        return tokens

    assert draw(0) == draw(4)


def test_prompt_logprobs_of_given_logits():
    logits = randn(3, 12)
    out = Sampler.prompt_logprobs(logits, [4, 0, 7], top=2)
    logp = log_softmax64(logits)
    for row, (target, entry) in enumerate(zip([4, 0, 7], out)):
        assert abs(entry[target] - float(logp[row, target])) < 1e-6
        assert set(np.argsort(-logp[row])[:2].tolist()) <= set(entry) and len(entry) <= 3
    assert [len(entry) for entry in Sampler.prompt_logprobs(logits, [4, 0, 7], top=0)] == [1, 1, 1]


def test_argmax_is_all_only_for_greedy_rows_nothing_reads_or_adjusts():
    """The runner may skip the full logits only for such rows (ModelRunner.execute)."""
    greedy = SamplingParams(temperature=0.0)
    assert Sampler.argmax_is_all(requests(greedy, greedy))
    for other in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.0, logprobs=0),
                  SamplingParams(temperature=0.0, logit_bias={3: 1.0}), SamplingParams(temperature=0.0, presence_penalty=0.5),
                  SamplingParams(temperature=0.0, repetition_penalty=1.1), SamplingParams(temperature=0.0, min_tokens=2)):
        assert not Sampler.argmax_is_all(requests(greedy, other)), other
    held = made_request("held", [1], [2], SamplingParams(temperature=0.0, min_tokens=2))
    done = made_request("done", [1], [2, 3], SamplingParams(temperature=0.0, min_tokens=2))
    assert not Sampler.argmax_is_all([held]) and Sampler.argmax_is_all([done])  # min_tokens reached: nothing held back


def sorted_row_reference(scaled: np.ndarray, params: list[SamplingParams]) -> tuple[np.ndarray, np.ndarray]:
    """top-k then top-p by sorting each whole row in float64 (the textbook way): the row with
    dropped tokens at -inf, and each token's mass before it in the order of the sort."""
    vocab = scaled.shape[-1]
    order = np.argsort(-scaled.astype(np.float64), axis=-1, kind="stable")
    sorted_logits = np.take_along_axis(scaled.astype(np.float64), order, -1)
    top_k = np.minimum(np.array([p.top_k if p.top_k > 0 else vocab for p in params]), vocab)
    drop = np.arange(vocab)[None, :] >= top_k[:, None]
    probs = softmax64(np.where(drop, NEG_INF, sorted_logits))
    mass_before = np.cumsum(probs, axis=-1) - probs
    drop |= mass_before >= np.array([p.top_p for p in params], dtype=np.float64)[:, None]
    drop[:, 0] = False
    kept, before = np.empty_like(scaled), np.empty_like(mass_before)
    np.put_along_axis(kept, order, np.where(drop, NEG_INF, np.take_along_axis(scaled, order, -1)), -1)
    np.put_along_axis(before, order, mass_before, -1)
    return kept, before


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 3000), spread=st.floats(0.01, 8.0),
       rows=st.lists(st.tuples(st.sampled_from([0, 1, 2, 5, 40, 300, 5000]),
                               st.sampled_from([1.0, 0.99, 0.95, 0.9, 0.5, 0.1, 0.001])), min_size=1, max_size=6))
def test_nucleus_candidates_keep_what_a_full_sort_keeps(seed, vocab, spread, rows):
    # Flat rows (small spread) make the nucleus run past the first window, so it widens.
    scaled = randn(len(rows), vocab, seed=seed, scale=spread)
    params = [SamplingParams(top_k=k, top_p=p) for k, p in rows]
    ids, values = nucleus_candidates(scaled, params)
    expected, mass_before = sorted_row_reference(scaled, params)
    for row in range(len(rows)):
        kept = values[row] > NEG_INF
        # Best first, each with its own logit.
        assert np.array_equal(values[row][kept], scaled[row, ids[row][kept]])
        assert bool((np.diff(values[row][kept]) <= 0).all())
        want = set(np.flatnonzero(expected[row] > NEG_INF).tolist())
        got = set(ids[row][kept].tolist())
        # The reference sums in float64 from float64 exponentials: only tokens whose mass before
        # them is top_p to within rounding may differ (with top_p 1, those of a tail too light to
        # sample).
        for token in got ^ want:
            assert abs(float(mass_before[row, token]) - rows[row][1]) < 1e-5, (row, rows[row], token)


def test_a_flat_nucleus_widens_the_window_to_its_end():
    vocab = 20_000
    scaled = np.linspace(0.0, -0.5, vocab, dtype=np.float32)[None, :]
    ids, values = nucleus_candidates(scaled, [SamplingParams(top_p=0.9)])
    kept = int((values > NEG_INF).sum())
    assert kept > 8 * FIRST_CANDIDATE_WIDTH  # past two widenings
    assert kept == int((sorted_row_reference(scaled, [SamplingParams(top_p=0.9)])[0] > NEG_INF).sum())


def seeded_uniform(seed: int) -> float:
    """A seeded request's first uniform number: numpy's PCG64 seeded by its seed."""
    return float(np.random.Generator(np.random.PCG64(seed)).random())


def whole_row_draw_reference(kept: np.ndarray, uniform: float) -> int:
    """The first token (in vocabulary order) whose float64 cumulative mass exceeds `uniform` of the total."""
    cdf = np.cumsum(softmax64(kept))
    return int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))


def test_truncated_rows_draw_what_a_draw_over_the_whole_sorted_row_draws():
    rows, vocab = 64, 4000
    logits = randn(rows, vocab, seed=5, scale=2)
    params = [SamplingParams(temperature=0.8, top_k=[0, 40, 400][i % 3], top_p=[0.95, 1.0, 0.7, 0.99][i % 4], seed=i)
              for i in range(rows)]
    params = [p if p.top_k or p.top_p < 1.0 else SamplingParams(temperature=0.8, top_p=0.9, seed=p.seed) for p in params]
    tokens = Sampler()(logits, requests(*params)).tokens
    truncated = sorted_row_reference(logits / np.float32(0.8), params)[0]
    assert tokens == [whole_row_draw_reference(truncated[i], seeded_uniform(i)) for i in range(rows)]


@pytest.mark.parametrize("vocab", [7, 1024, 5000, 151_936])
def test_untruncated_rows_draw_what_a_float64_running_sum_over_the_row_draws(vocab: int) -> None:
    # Whole rows are drawn by blocks (a block's sum, then a running sum within it); rows with
    # banned tokens (-inf: never drawn), min-p and flat ones.
    rows = 24
    logits = randn(rows, vocab, seed=vocab, scale=3)
    logits[::3, : vocab // 2] = NEG_INF
    params = [SamplingParams(temperature=[0.5, 1.0, 1.7][i % 3], min_p=[0.0, 0.0, 0.0, 0.05][i % 4], seed=100 + i)
              for i in range(rows)]
    tokens = Sampler()(logits, requests(*params)).tokens
    for i, p in enumerate(params):
        scaled = logits[i] / np.float32(p.temperature)
        if p.min_p:
            scaled = np.where(scaled < scaled.max() + np.log(np.float32(p.min_p)), NEG_INF, scaled)
        assert tokens[i] == whole_row_draw_reference(scaled, seeded_uniform(100 + i)), i
        assert np.isfinite(logits[i, tokens[i]])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), histories=st.lists(
    st.tuples(st.lists(st.integers(0, 63), min_size=1, max_size=30), st.lists(st.integers(0, 63), max_size=30),
              st.sampled_from([1.0, 1.05, 1.5]), st.sampled_from([0.0, 0.5, -1.0]), st.sampled_from([0.0, 0.25, 2.0])),
    min_size=1, max_size=5))
def test_penalties_touch_only_seen_tokens_and_follow_their_definitions(seed, histories):
    logits = randn(len(histories), 64, seed=seed, scale=3)
    reqs = [made_request(str(i), prompt, output, SamplingParams(repetition_penalty=r, frequency_penalty=f,
                                                                 presence_penalty=p))
            for i, (prompt, output, r, f, p) in enumerate(histories)]
    adjusted = adjust_logits(logits, reqs)
    for row, request in enumerate(reqs):
        p = request.sampling_params
        seen = set(request.output_token_ids) | (set(request.prompt_token_ids) if p.repetition_penalty != 1.0 else set())
        unseen = [t for t in range(64) if t not in seen]
        assert np.array_equal(adjusted[row, unseen], logits[row, unseen])
        assert np.allclose(adjusted[row], reference_adjusted(logits[row], request), atol=1e-5, rtol=0)


def test_rows_left_without_a_token_are_reported_and_only_masked_rows_are_looked_at():
    logits = randn(4, 50)
    logits[3] = NEG_INF  # a grammar mask allowed nothing on this row
    params = [SamplingParams(allowed_token_ids=[7], bad_words_token_ids=[[7]]),  # bans its only token
              SamplingParams(allowed_token_ids=[7, 8], bad_words_token_ids=[[7]]),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8)]
    out = Sampler()(logits, requests(*params), masked_rows=[3])
    assert out.blocked == [0, 3] and out.tokens[1] == 8
    assert Sampler()(logits[:3], requests(*params[:3])).blocked == [0]
    # An unconstrained row is never inspected, whatever its logits.
    assert Sampler()(np.full((1, 50), NEG_INF, dtype=np.float32), requests(SamplingParams())).blocked is None


@pytest.mark.parametrize("fill", [NEG_INF, float("nan")])
def test_a_row_of_no_number_or_no_token_still_gets_a_token_id(fill: float) -> None:
    # The engine ends a blocked row's request; a NaN row is the model's fault. Neither may raise here.
    vocab = 3000
    logits = np.full((8, vocab), fill, dtype=np.float32)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(top_p=0.9),
              SamplingParams(top_k=40, top_p=0.9, min_p=0.1), SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8,
                             sampler_chain=("top_k", "top_p", "min_p", "temperature")),
              SamplingParams(top_p=0.95, min_p=0.05, sampler_chain=("top_p", "min_p", "temperature")),
              SamplingParams(seed=3, repetition_penalty=1.2)]
    out = Sampler()(logits, requests(*params))
    assert all(0 <= t < vocab for t in out.tokens)


def test_a_verified_request_is_blocked_only_by_the_row_it_keeps():
    logits = randn(3, 20)
    logits[1] = NEG_INF  # the row after the first draft: used only if the draft is kept
    request = Request("r", [1], SamplingParams(temperature=0.0), 0.0)
    request.spec_token_ids = [int(logits[0].argmax())]  # kept, so row 1 decides
    assert Sampler().verify(logits[:2], [request], masked_rows=[0, 1]).blocked == [0]
    request.spec_token_ids = [(int(logits[0].argmax()) + 1) % 20]  # rejected: row 0 decides
    assert Sampler().verify(logits[:2], [request], masked_rows=[0, 1]).blocked is None


def test_a_seeded_request_draws_the_same_whether_it_speculated_or_not() -> None:
    # Its generator ends where drawing only the rows it keeps leaves it (Sampler.verify).
    vocab, steps = 50, 12
    logits = randn(steps + 4, vocab, seed=8, scale=0.5)
    params = SamplingParams(temperature=1.0, seed=21)
    plain, plain_request = Sampler(), Request("p", [1], params, 0.0)
    expected = [plain(logits[i:i + 1], [plain_request]).tokens[0] for i in range(steps)]
    sampler, request = Sampler(), Request("s", [1], params, 0.0)
    got: list[int] = []
    while len(got) < steps:
        at = len(got)
        request.spec_token_ids = [expected[at] if at % 2 else (expected[at] + 1) % vocab, 3]
        out = sampler.verify(logits[at:at + 3], [request])
        got += request.spec_token_ids[:out.num_accepted[0]] + out.tokens
    assert got[:steps] == expected


def test_a_seeded_generator_state_travels_and_a_broken_one_is_refused() -> None:
    logits = randn(1, 500, scale=0.3)
    params = SamplingParams(temperature=1.0, seed=9)
    source, request = Sampler(), Request("r", [1], params, 0.0)
    assert source.generator_state(request) is None
    source(logits, [request])
    state = source.generator_state(request)
    assert state is not None and state.dtype == np.uint8
    check_generator_state(state)
    moved, twin = Sampler(seed=5), Request("r", [1], params, 0.0)
    moved.set_generator_state(twin, state)
    assert [source(logits, [request]).tokens for _ in range(5)] == [moved(logits, [twin]).tokens for _ in range(5)]
    for broken in (state[:7], state.astype(np.int64), "state", np.concatenate([state, state])):
        with pytest.raises((TypeError, ValueError)):
            check_generator_state(broken)


def test_a_restored_rng_state_draws_again_what_it_drew() -> None:
    logits = randn(3, 800, scale=0.3)
    reqs = [Request("a", [1], SamplingParams(temperature=1.0, seed=2), 0.0), Request("b", [1], SamplingParams(), 0.0),
            Request("c", [1], SamplingParams(temperature=1.0, seed=4), 0.0)]
    sampler = Sampler()
    sampler(logits[:1], reqs[:1])  # "a" has drawn once; "c" has no generator yet
    state = sampler.save_rng_state(reqs)
    first = sampler(logits, reqs).tokens
    sampler.restore_rng_state(state)
    assert sampler(logits, reqs).tokens == first


def test_a_tokens_rank_counts_those_at_least_as_likely_as_vllm_counts_them() -> None:
    from conveyor.sampling.outputs import TokenLogprobs
    from conveyor.sampling.sampler import Sampler

    logits = np.array([[2.0, 1.0, 1.0, 0.0, -1.0]] * 4, dtype=np.float32)
    scored = Sampler.prompt_logprobs(logits, [0, 2, 3, 4], top=0)  # the likeliest, a tie, below it, the last
    assert all(isinstance(step, TokenLogprobs) for step in scored)
    assert [step.rank for step in scored] == [1, 3, 4, 5]
    drawn = Sampler._logprobs(logits[:2], [1, 4], [0, 2])
    assert [step.rank for step in drawn] == [3, 5] and len(drawn[1]) == 3  # its own entry and the top 2

