"""A step that raises fails only the request(s) that make it raise (issue 18, case 1): the engine
bisects the batch, fails the culprits with RequestFailedError (blocks freed), and the others go on
with exactly the outputs of a run without the culprits."""
from __future__ import annotations

import pytest

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import RequestFailedError
from conveyor.sampling import SamplingParams
from tests.fakes import FailingRunner

POISON = 990


def fake_engine(runner: FailingRunner, **sched: object) -> LLMEngine:
    config = EngineConfig.from_kwargs(num_kv_blocks=64, block_size=4, **sched)
    return LLMEngine(config, runner, num_kv_blocks=64, max_model_len=256, vocab_size=1000)


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results: dict[str, list] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                results.setdefault(out.request_id, []).append(out)
    return {i: results[i] for i in ids}


@pytest.mark.parametrize("num_good", [1, 5, 12])
def test_only_the_poisoned_requests_fail_and_the_others_match_a_clean_run(num_good):
    good = [[10 + i, 20 + i, 30 + i] * (1 + i % 3) for i in range(num_good)]
    params = [SamplingParams(max_tokens=6 + i % 4, n=1 + (i % 3 == 1)) for i in range(num_good)]
    clean = run(fake_engine(FailingRunner({POISON})), good, params)

    runner = FailingRunner({POISON, POISON + 1})
    engine = fake_engine(runner)
    bad = [[POISON, 1, 2], [POISON + 1, 3, 4, 5, 6]]
    mixed = run(engine, good[:1] + bad[:1] + good[1:] + bad[1:],
                params[:1] + [SamplingParams(max_tokens=4, n=2)] + params[1:] + [SamplingParams(max_tokens=4)])
    outs = list(mixed.values())
    failed = [outs[1], outs[-1]]
    for [out] in failed:
        assert out.finished and out.finish_reason == "error" and isinstance(out.error, RequestFailedError)
    survivors = outs[:1] + outs[2:-1]
    assert [[o.token_ids for o in sorted(s, key=lambda o: o.index)] for s in survivors] == \
           [[o.token_ids for o in sorted(s, key=lambda o: o.index)] for s in clean.values()]
    assert all(o.error is None for s in survivors for o in s)
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks and not engine.scheduler.kv.block_tables
    assert not engine._unfinished_samples and not engine.scheduler.requests


def test_a_step_that_fails_for_everyone_raises():
    runner = FailingRunner(set(range(1000)))
    engine = fake_engine(runner)
    for i in range(4):
        engine.add_request([i, 5, 6], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="poisoned"):
        engine.step()


def test_bisection_needs_few_retries():
    runner = FailingRunner({POISON})
    engine = fake_engine(runner, max_num_seqs=64)
    for i in range(31):
        engine.add_request([10 + i, 1, 2], SamplingParams(max_tokens=2))
    engine.add_request([POISON, 1, 2], SamplingParams(max_tokens=2))
    engine.step()
    # The full step, two halves per level of a 32-request bisection (5 levels), the survivors once.
    assert runner.calls <= 1 + 2 * 5 + 1


def _poison_after(monkeypatch, model_or_sampler, method: str, is_poisoned) -> None:
    original = getattr(model_or_sampler, method)

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)  # the real work first: KV written, numbers drawn
        if is_poisoned(*args):
            raise RuntimeError("injected failure")
        return result

    monkeypatch.setattr(model_or_sampler, method, wrapped)  # the model is shared by the session's engines


GOOD_PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time"]
GOOD_PARAMS = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
               SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True),
               SamplingParams(max_tokens=8, temperature=0.7, top_k=40, seed=3, n=2, ignore_eos=True)]


def _tokens(results: dict[str, list]) -> list[list[list[int]]]:
    return [[o.token_ids for o in sorted(r, key=lambda o: o.index)] for r in results.values()]


@pytest.mark.parametrize("where", ["model", "sampler"])
def test_real_model_survivors_match_a_clean_run(make_engine, where, monkeypatch):
    clean = _tokens(run(make_engine(), GOOD_PROMPTS, GOOD_PARAMS))
    engine = make_engine()
    poison_id = engine.tokenizer.encode("Zebra")[0]
    if where == "model":  # after the whole forward pass has written every row's KV
        _poison_after(monkeypatch, engine.runner.model, "sampling_hidden",
                      lambda ids, *rest: bool((ids == poison_id).any()))
    else:  # after the sampler has drawn from every request's generator
        sampler = engine.runner.sampler
        _poison_after(monkeypatch, sampler, "_uniforms", lambda requests: any(r.prompt_token_ids[0] == poison_id
                                                                              for r in requests))
    prompts = GOOD_PROMPTS[:1] + ["Zebra crossings are"] + GOOD_PROMPTS[1:]
    params = GOOD_PARAMS[:1] + [SamplingParams(max_tokens=8, temperature=1.0, seed=1)] + GOOD_PARAMS[1:]
    results = run(engine, prompts, params)
    outs = list(results.values())
    assert isinstance(outs[1][0].error, RequestFailedError)
    assert _tokens({k: v for i, (k, v) in enumerate(results.items()) if i != 1}) == clean
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks
