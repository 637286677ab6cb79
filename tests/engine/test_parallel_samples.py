"""n > 1: samples share the prompt's KV blocks (ref counts) and copy a block only on write."""
from __future__ import annotations

from conveyor.config import EngineConfig, SchedulerConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import InvalidRequestError
from conveyor.kv.manager import blocks_for
from conveyor.sampling import SamplingParams
from tests.fakes import FakeRunner

PROMPT = "The history of trains began in"  # 7 tokens: the last prompt block is shared and partly full


def collect(engine: LLMEngine) -> dict[tuple[str, int], list[int]]:
    results = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                results[(out.request_id, out.index)] = list(out.token_ids)
    return results


def test_samples_equal_independent_requests_with_derived_seeds(make_engine):
    engine = make_engine(block_size=4)
    params = dict(max_tokens=12, temperature=1.0, top_p=0.9, ignore_eos=True)
    rid = engine.add_request(PROMPT, SamplingParams(n=3, seed=100, **params))
    prompt_len = len(engine.tokenizer.encode(PROMPT))
    engine.step()  # prefill: the prompt's blocks, computed once
    prompt_blocks = blocks_for(prompt_len + 1, 4)
    assert engine.scheduler.kv.usage().used_blocks == prompt_blocks
    assert len(engine.scheduler.running) == 3
    engine.step()  # each sample writes its second token: the shared partial block is copied
    assert engine.scheduler.kv.usage().used_blocks < 3 * prompt_blocks
    samples = collect(engine)
    assert sorted(samples) == [(rid, 0), (rid, 1), (rid, 2)]
    assert len({tuple(v) for v in samples.values()}) == 3

    reference = make_engine(block_size=4)
    ids = [reference.add_request(PROMPT, SamplingParams(seed=100 + i, **params)) for i in range(3)]
    alone = collect(reference)
    for i, ref_id in enumerate(ids):
        assert samples[(rid, i)] == alone[(ref_id, 0)], f"sample {i} differs from its standalone twin"
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks


def test_greedy_samples_are_identical(make_engine):
    engine = make_engine(block_size=16)
    rid = engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=10, temperature=0.0, ignore_eos=True))
    single = engine.add_request(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    results = collect(engine)
    assert results[(rid, 0)] == results[(rid, 1)] == results[(single, 0)]


def fake_engine(**sched: object) -> LLMEngine:
    config = EngineConfig(block_size=4, scheduler=SchedulerConfig(**sched))
    return LLMEngine(config, FakeRunner(), num_kv_blocks=64, max_model_len=128, vocab_size=1000)


def test_abort_takes_every_sample_and_frees_shared_blocks():
    engine = fake_engine(max_num_seqs=8)
    rid = engine.add_request(list(range(1, 11)), SamplingParams(n=4, max_tokens=20, ignore_eos=True))
    other = engine.add_request(list(range(5, 9)), SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 5
    assert engine.abort_request(rid) and not engine.abort_request(rid)
    assert [r.request_id for r in engine.scheduler.running] == [other]
    results = collect(engine)
    assert list(results) == [(other, 0)]
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks


def test_n_counts_against_max_num_seqs():
    for policy in ("continuous", "static"):
        engine = fake_engine(max_num_seqs=4, policy=policy)
        first = engine.add_request([1, 2, 3], SamplingParams(n=3, max_tokens=4, ignore_eos=True))
        second = engine.add_request([4, 5, 6], SamplingParams(n=2, max_tokens=4, ignore_eos=True))
        peak = 0
        while engine.has_unfinished_requests:
            engine.step()
            peak = max(peak, engine.scheduler.num_running)
        assert peak <= 4
        try:
            engine.add_request([1], SamplingParams(n=5))
        except InvalidRequestError as exc:
            assert "max_num_seqs" in str(exc)
        else:
            raise AssertionError("n > max_num_seqs must be rejected")
        assert first != second
