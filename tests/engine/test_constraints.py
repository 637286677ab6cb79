"""Constraints that leave no token (allowed_token_ids, bad words, min_tokens, a grammar): refused
when it shows up front, else the request ends with an error at the step where it shows, never
with a token that breaks them; the other requests of the batch are not affected."""
from __future__ import annotations

import pytest

from conveyor.errors import InvalidRequestError, NoAllowedTokenError
from conveyor.sampling import SamplingParams
from conveyor.structured.spec import GrammarSpec
from tests.structured.test_matchers import EOS, VOCAB, make_engine, run

A, B = VOCAB.index("a"), VOCAB.index("b")


@pytest.mark.parametrize("params,param", [
    (SamplingParams(allowed_token_ids=[A], bad_words_token_ids=[[A]]), "allowed_token_ids"),
    (SamplingParams(allowed_token_ids=[A, B], bad_words_token_ids=[[B], [A]]), "allowed_token_ids"),
    (SamplingParams(allowed_token_ids=[EOS], min_tokens=2), "min_tokens"),
    (SamplingParams(allowed_token_ids=[EOS, B], stop_token_ids=[B], min_tokens=1), "min_tokens"),
    (SamplingParams(allowed_token_ids=[A, B], bad_words_token_ids=[[A]], stop_token_ids=[B], min_tokens=1),
     "min_tokens"),
], ids=["bad word bans the only allowed token", "bad words ban them all", "only EOS before min_tokens",
        "only a stop token or EOS", "a bad word and a stop token"])
def test_constraints_that_leave_no_token_up_front_are_refused(params, param):
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as caught:
        engine.add_request([1, 2], params)
    assert caught.value.param == param and not engine.has_unfinished_requests
    # With the clash lifted the same fields are served.
    engine.add_request([1, 2], SamplingParams(allowed_token_ids=[EOS, A], min_tokens=1, max_tokens=3))


@pytest.mark.parametrize("params,param", [
    # "a" may not follow "a", and "b" is always banned: the second token has nothing left.
    (SamplingParams(allowed_token_ids=[A, B], bad_words_token_ids=[[B], [A, A]], max_tokens=5, temperature=1.0),
     "allowed_token_ids"),
    # No JSON can be made of "a" and "b".
    (SamplingParams(allowed_token_ids=[A, B], structured=GrammarSpec.json_object(), max_tokens=5),
     "allowed_token_ids"),
    # The grammar's only way on after "a" is "b", a bad word.
    (SamplingParams(structured=GrammarSpec.choice(["ab"]), bad_words_token_ids=[[B]], max_tokens=8), "bad_words"),
], ids=["a bad word after a token", "allowed tokens that cannot form JSON", "a grammar and a bad word"])
def test_a_step_with_no_token_allowed_ends_that_request_with_an_error(params, param):
    engine = make_engine()
    other = engine.add_request([3, 4], SamplingParams(max_tokens=4, temperature=0.0))
    alone = make_engine()
    alone.add_request([3, 4], SamplingParams(max_tokens=4, temperature=0.0))
    stuck = engine.add_request([1, 2], params)
    done = run(engine)
    out = done[stuck][-1]
    assert out.finish_reason == "error" and isinstance(out.error, NoAllowedTokenError)
    assert out.error.param == param
    allowed = set(params.allowed_token_ids or range(len(VOCAB)))
    assert set(out.token_ids) <= allowed and EOS not in out.token_ids  # nothing outside the constraints
    assert done[other][-1].token_ids == next(iter(run(alone).values()))[-1].token_ids
    assert not engine.scheduler.requests and engine.scheduler.kv.usage().usage == 0.0
