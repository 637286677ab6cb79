"""Prefix caching on the real default model changes no output: greedy tokens and seeded samples are
identical with the cache on and off, under chunked prefill, a tiny pool (preemption storms), n > 1,
aborts and the next turn of a conversation (which hits the previous turn's answer)."""
from __future__ import annotations

import pytest

from conveyor.engine.llm_engine import LLMEngine
from conveyor.sampling import SamplingParams

SYSTEM = (
    "<|im_start|>system\nYou are a careful assistant. Answer in one short sentence, name your sources "
    "when you can, and say so when you do not know.<|im_end|>\n<|im_start|>user\n"
)
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 12 times 12?",
             "Who wrote Hamlet?"]
NEW = 6


def prompts(engine: LLMEngine) -> list[list[int]]:
    return [engine.tokenizer.encode(SYSTEM + q + "<|im_end|>\n<|im_start|>assistant\n") for q in QUESTIONS]


def params(i: int) -> SamplingParams:
    # Alternate greedy and seeded sampling, so both are covered.
    if i % 2:
        return SamplingParams(max_tokens=NEW, temperature=0.8, top_p=0.95, seed=1000 + i, ignore_eos=True)
    return SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], arrive_every: int = 1,
        abort: set[int] = frozenset()) -> dict[tuple[int, int], list[int]]:  # type: ignore[assignment]
    """Request i arrives at step i * arrive_every; the ones in `abort` are aborted two steps later."""
    ids: list[str] = []
    results: dict[tuple[int, int], list[int]] = {}
    step = 0
    while len(ids) < len(requests) or engine.has_unfinished_requests:
        while len(ids) < len(requests) and step >= len(ids) * arrive_every:
            ids.append(engine.add_request(*requests[len(ids)]))
        for i in abort:
            if i < len(ids) and step == i * arrive_every + 2:
                engine.abort_request(ids[i])
        for out in engine.step():
            if out.finished:
                results[(ids.index(out.request_id), out.index)] = list(out.token_ids)
        step += 1
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks and engine.scheduler.kv.usage().used_blocks == 0
    return results


@pytest.mark.parametrize(
    "case, kwargs",
    [
        ("chunked", dict(max_num_batched_tokens=40, max_num_seqs=4)),
        ("preemption storm", dict(num_kv_blocks=12, block_size=8, max_num_seqs=5)),
        ("static", dict(policy="static", max_num_seqs=3)),
    ],
)
def test_the_cache_changes_no_output(make_engine, case, kwargs) -> None:
    on, off = make_engine(**kwargs), make_engine(enable_prefix_caching=False, **kwargs)
    requests = [(p, params(i)) for i, p in enumerate(prompts(on))]
    requests.append((requests[0][0], SamplingParams(max_tokens=NEW, temperature=1.0, seed=7, n=3, ignore_eos=True)))
    with_cache, without = run(on, requests, abort={3}), run(off, requests, abort={3})
    assert with_cache == without, case
    assert len(with_cache) == len(requests) - 1 + 2  # request 3 aborted; n = 3 gives three samples
    s = on.scheduler
    assert s.prefix_cache_hits > 0 and off.scheduler.prefix_cache_queries == 0
    if case == "preemption storm":
        assert s.num_preemptions > 0


def test_the_next_turn_hits_the_previous_answer(make_engine) -> None:
    on, off = make_engine(max_num_seqs=4), make_engine(max_num_seqs=4, enable_prefix_caching=False)
    first = prompts(on)[0]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    answer = run(on, [(first, greedy)])[(0, 0)]
    assert answer == run(off, [(first, greedy)])[(0, 0)]
    follow = on.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd of Spain?<|im_end|>\n<|im_start|>assistant\n")
    turn2 = first + answer + follow
    hits_before = on.scheduler.prefix_cache_hits
    rid = on.add_request(turn2, greedy)
    outs = []
    while on.has_unfinished_requests:
        outs += [o for o in on.step() if o.finished and o.request_id == rid]
    cached = outs[0].num_cached_tokens
    computed = len(first) + len(answer) - 1  # the answer's last token never had its KV written
    assert cached == (computed // on.scheduler.kv.block_size) * on.scheduler.kv.block_size > len(first)
    assert on.scheduler.prefix_cache_hits - hits_before == cached
    assert outs[0].token_ids == run(off, [(turn2, greedy)])[(0, 0)]


def test_prompt_logprobs_are_computed_even_where_the_prefix_is_cached(make_engine) -> None:
    """A hit skips computing the prompt positions whose logits score the next prompt tokens, so a
    request asking for prompt logprobs does not read the cache past what it has scored."""
    engine = make_engine(max_num_seqs=4)
    prompt = prompts(engine)[0]
    run(engine, [(prompt, SamplingParams(max_tokens=2, temperature=0.0))])  # caches the prompt
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
    outs = []
    while engine.has_unfinished_requests:
        outs += [o for o in engine.step() if o.request_id == rid and o.prompt_logprobs is not None]
    scored = outs[0].prompt_logprobs
    assert outs[0].num_cached_tokens == 0
    assert len(scored) == len(prompt) and scored[0] is None and all(e and prompt[i] in e
                                                                   for i, e in enumerate(scored) if i)
    again = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0))  # the cache still serves others
    while engine.has_unfinished_requests:
        outs += [o for o in engine.step() if o.request_id == again and o.finished]
    assert outs[-1].num_cached_tokens > 0
