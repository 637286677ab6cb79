"""Workload generators: seeded determinism, length statistics, arrival processes."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conveyor.bench.workloads import FIRST_REGULAR_ID, WorkloadConfig, arrival_times, generate_requests


def test_same_seed_same_requests_other_seed_other_requests() -> None:
    for dataset in ("random", "uniform", "chat", "seed", "long-prompts"):
        cfg = WorkloadConfig(dataset=dataset, num_prompts=20, range_ratio=0.5, seed=3)
        assert generate_requests(cfg) == generate_requests(WorkloadConfig(**vars(cfg)))
        other = generate_requests(WorkloadConfig(**{**vars(cfg), "seed": 4}))
        assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in generate_requests(cfg)]


def test_token_ids_avoid_special_ids_and_stay_in_vocab() -> None:
    requests = generate_requests(WorkloadConfig(dataset="chat", num_prompts=200, vocab_size=500))
    ids = np.concatenate([r.prompt_token_ids for r in requests])
    assert ids.min() >= FIRST_REGULAR_ID and ids.max() < 500
    assert all(isinstance(t, int) for t in requests[0].prompt_token_ids)


def test_seed_outputs_average_300_with_a_long_tail() -> None:
    outs = np.array([r.output_len for r in generate_requests(WorkloadConfig(dataset="seed", num_prompts=4000))])
    assert outs.mean() == pytest.approx(300, rel=0.05)
    assert np.median(outs) < 0.8 * outs.mean()  # skewed: most are short
    assert np.percentile(outs, 99) > 3 * outs.mean()  # and a few are very long
    assert outs.min() >= 8


def test_chat_is_long_tailed_and_sharegpt_sized() -> None:
    requests = generate_requests(WorkloadConfig(dataset="chat", num_prompts=4000))
    ins = np.array([r.prompt_len for r in requests])
    outs = np.array([r.output_len for r in requests])
    assert 120 < ins.mean() < 180 and 280 < outs.mean() < 360
    assert np.median(ins) < 0.7 * ins.mean() and ins.max() <= 1024 and outs.max() <= 1024


def test_uniform_is_all_equal_and_random_respects_range_ratio() -> None:
    uniform = generate_requests(WorkloadConfig(dataset="uniform", num_prompts=50, input_len=64, output_len=32))
    assert {(r.prompt_len, r.output_len) for r in uniform} == {(64, 32)}
    rand = generate_requests(WorkloadConfig(dataset="random", num_prompts=500, input_len=100, output_len=40,
                                            range_ratio=0.5))
    ins = [r.prompt_len for r in rand]
    outs = [r.output_len for r in rand]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 50
    assert min(outs) >= 20 and max(outs) <= 60


def test_long_prompts_mix_is_decode_heavy_with_spaced_long_prompts() -> None:
    cfg = WorkloadConfig(dataset="long-prompts", num_prompts=32, long_prompt_len=512, long_prompt_every=8)
    requests = generate_requests(cfg)
    long = [i for i, r in enumerate(requests) if r.prompt_len == 512]
    assert long == [4, 12, 20, 28]
    assert all(requests[i].output_len == 16 for i in long)
    short = [r for i, r in enumerate(requests) if i not in long]
    assert {r.prompt_len for r in short} == {32}
    assert all(64 <= r.output_len <= 192 for r in short) and len({r.output_len for r in short}) > 10


def test_arrivals_all_at_once_or_at_the_requested_rate() -> None:
    assert arrival_times(5, math.inf) == [0.0] * 5
    times = np.array(arrival_times(2000, request_rate=8.0, burstiness=1.0, seed=1))
    assert np.all(np.diff(times) >= 0)
    assert len(times) / times[-1] == pytest.approx(8.0)  # span pinned to n / rate, as vLLM does
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)  # Poisson: exponential gaps, CV 1
    bursty = np.diff(arrival_times(2000, 8.0, burstiness=0.25, seed=1))
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, abs=0.3)  # gamma shape k: CV 1/sqrt(k)
    regular = np.diff(arrival_times(100, 4.0, burstiness=math.inf))
    assert regular == pytest.approx(np.full(99, 0.25))
    assert arrival_times(50, 8.0, seed=2) == arrival_times(50, 8.0, seed=2)
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def test_questions_ask_for_stdlib_functions_in_the_chat_template() -> None:
    """Real prompts (a function's signature and docstring summary, in the model's chat template),
    the same for the same seed, another seed starting elsewhere; the output length is a cap."""
    import textwrap

    from conveyor.errors import ConfigError
    from conveyor.model.loader import load_tokenizer

    with pytest.raises(ConfigError, match="tokenizer"):
        generate_requests(WorkloadConfig(dataset="questions", num_prompts=2))
    cfg = WorkloadConfig(dataset="questions", num_prompts=3, tokenizer="smollm2-135m")
    requests = generate_requests(cfg)
    assert requests == generate_requests(WorkloadConfig(**vars(cfg)))
    assert all(r.output_len == 256 for r in requests)
    text = load_tokenizer("smollm2-135m").decode(requests[0].prompt_token_ids, skip_special_tokens=False)
    assert "<|im_start|>user" in text and "Write a Python function `dedent(text)`" in text
    assert textwrap.dedent.__doc__.strip().splitlines()[0] in text
    other = generate_requests(WorkloadConfig(**{**vars(cfg), "seed": 1, "output_len": 64}))
    assert other[0].prompt_token_ids != requests[0].prompt_token_ids and other[0].output_len == 64
