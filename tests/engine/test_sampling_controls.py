"""Sampling controls on the real default model: min_tokens holds EOS and stop tokens back, and
prompt logprobs equal a reference log_softmax over the whole prompt's logits (HF transformers),
however the prompt is chunked."""
from __future__ import annotations

import pytest
import torch

from conveyor.errors import InvalidRequestError
from conveyor.sampling import SamplingParams
from tests.engine.test_engine_api import finish_all

CHAT = [{"role": "user", "content": "Hi"}]


def test_min_tokens_holds_eos_and_stop_tokens_back(make_engine):
    engine = make_engine()
    chat = engine.tokenizer.apply_chat_template(CHAT)
    free = engine.add_request(chat, SamplingParams(max_tokens=64, temperature=0.0))
    first = finish_all(engine)[free]
    eos_at = len(first.token_ids)
    assert first.finish_reason == "stop" and eos_at < 40  # greedy ends early on its own
    stop_token = first.token_ids[1]
    held = engine.add_request(chat, SamplingParams(max_tokens=64, temperature=0.0, min_tokens=eos_at + 8))
    by_token = engine.add_request(chat, SamplingParams(max_tokens=64, temperature=0.0, min_tokens=4,
                                                       stop_token_ids=[stop_token]))
    results = finish_all(engine)
    out = results[held].token_ids
    assert len(out) >= eos_at + 8  # EOS could not be sampled before min_tokens ...
    assert not set(out[: eos_at + 7]) & set(engine.tokenizer.eos_token_ids)
    assert out[: eos_at - 1] == first.token_ids[: eos_at - 1]  # ... and nothing else changed before it
    stopped = results[by_token]
    assert stop_token not in stopped.token_ids[:3]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) >= 4
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=5)


def reference_prompt_logprobs(hf_reference_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_reference_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("budget", [2048, 7])  # one prefill step; chunks of 7 tokens
def test_prompt_logprobs_equal_a_reference_log_softmax(make_engine, hf_reference_model, budget):
    engine = make_engine(max_num_batched_tokens=budget, max_num_seqs=4)
    prompt = "The quick brown fox jumps over the lazy dog, and then it ran into the forest to hide."
    ids = engine.tokenizer.encode(prompt)
    assert len(ids) > 2 * 7  # three chunks of 7 at least
    rid = engine.add_request(ids, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2, n=2, seed=1))
    other = engine.add_request("Noise beside it", SamplingParams(max_tokens=3, temperature=0.0))
    outputs = []
    while engine.has_unfinished_requests:
        outputs += [o for o in engine.step() if o.request_id == rid]
    firsts = [o for o in outputs if o.prompt_logprobs is not None]
    assert sorted(o.index for o in firsts) == [0, 1]  # every sample carries them, once
    scored = firsts[0].prompt_logprobs
    assert len(scored) == len(ids) and scored[0] is None
    reference = reference_prompt_logprobs(hf_reference_model, ids)
    for position in range(1, len(ids)):
        entry, want = scored[position], reference[position - 1]
        assert abs(entry[ids[position]] - float(want[ids[position]])) < 0.05, position
        top = want.topk(2)
        assert len(entry) <= 3 and int(top.indices[0]) in entry  # the best alternative is among them
        assert abs(entry[int(top.indices[0])] - float(top.values[0])) < 0.05
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks and other is not None


def test_logit_bias_and_token_ids_are_checked_against_the_vocabulary(make_engine):
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.add_request("Hi", SamplingParams(logit_bias={10**7: 1.0}))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.add_request("Hi", SamplingParams(stop_token_ids=[10**7]))
    forced = engine.tokenizer.encode(" banana")[0]
    rid = engine.add_request("The capital of France is", SamplingParams(max_tokens=3, temperature=0.0,
                                                                       logit_bias={forced: 100.0}))
    assert finish_all(engine)[rid].token_ids == [forced] * 3
