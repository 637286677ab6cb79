from __future__ import annotations

import pytest
import torch

from conveyor.errors import InvalidRequestError
from conveyor.request import Request
from conveyor.sampling import SamplingParams
from conveyor.sampling.sampler import Sampler


def requests(*params: SamplingParams) -> list[Request]:
    return [Request(str(i), [1], p, 0.0) for i, p in enumerate(params)]


def test_greedy_is_argmax():
    logits = torch.randn(5, 100)
    assert Sampler()(logits, requests(*[SamplingParams(temperature=0.0)] * 5)).tokens == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(6, 100)
    out = Sampler()(logits, requests(*[SamplingParams(temperature=1.5, top_k=1)] * 6)).tokens
    assert out == logits.argmax(-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams()]
    out = Sampler()(logits, requests(*params)).tokens
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())


def test_seeded_request_is_reproducible_whatever_its_batch():
    torch.manual_seed(0)
    row = torch.randn(1, 1000)

    def draw(batch_before: int, batch_after: int) -> list[int]:
        target = Request("t", [1], SamplingParams(temperature=1.0, seed=1234), 0.0)
        others = requests(*[SamplingParams(temperature=1.0)] * (batch_before + batch_after))
        sampler, tokens = Sampler(seed=batch_before * 7 + 1), []
        for _ in range(20):
            batch = others[:batch_before] + [target] + others[batch_before:]
            logits = torch.randn(len(batch), 1000)
            logits[batch_before] = row
            tokens.append(sampler(logits, batch).tokens[batch_before])
        return tokens

    assert draw(0, 0) == draw(3, 5) == draw(7, 0)


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    out = torch.tensor(Sampler(seed=3)(logits, requests(*[SamplingParams(temperature=0.5)] * 20000)).tokens)
    freq = torch.bincount(out, minlength=4).float() / len(out)
    expected = (logits[0] / 0.5).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, -2.0]]).repeat(3000, 1)
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
    ],
)
def test_bad_sampling_params_raise_typed_error(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_logprobs_report_chosen_and_top_alternatives():
    logits = torch.randn(3, 40)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, logprobs=0)]
    out = Sampler(seed=5)(logits, requests(*params))
    assert out.logprobs is not None and out.logprobs[1] is None
    expected = torch.log_softmax(logits, dim=-1)
    top3 = expected[0].topk(3).indices.tolist()
    assert list(out.logprobs[0]) == top3  # greedy: the chosen token is the top one
    for token, value in out.logprobs[0].items():
        assert abs(value - float(expected[0, token])) < 1e-5
    assert list(out.logprobs[2]) == [out.tokens[2]]
    assert Sampler()(logits, requests(SamplingParams())).logprobs is None
