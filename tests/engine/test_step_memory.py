"""What a serving engine keeps of its steps' memory: the runner built from a config keeps up to twice
a full-budget step's working set free for the next step (model/memory.py), and a step whose prompt
logits outgrow that (prompt logprobs over a long prompt, a field a client sends) hands them back."""
from __future__ import annotations

import pytest

from conveyor.model.memory import step_working_set_bytes
from conveyor.runner import model_runner
from conveyor.sampling import SamplingParams


def finish(engine, params: SamplingParams, prompt: list[int]) -> list:  # noqa: ANN001
    """The request's outputs that carry its prompt logprobs."""
    engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests:
        outs += [o for o in engine.step() if o.prompt_logprobs is not None]
    return outs


def test_long_prompt_logits_are_handed_back_after_their_step(make_engine, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=256)
    runner = engine.runner
    cfg = runner.model_config
    assert runner.keep_free_bytes == 2 * step_working_set_bytes(cfg, 256, 2)
    handed_back: list[int] = []
    monkeypatch.setattr(model_runner, "return_freed_memory", lambda: handed_back.append(1))
    prompt = list(range(100, 140))

    finish(engine, SamplingParams(max_tokens=2, temperature=0.0), prompt)
    finish(engine, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1), prompt)
    assert handed_back == []  # 40 rows of logits are well inside what steps keep

    runner.keep_free_bytes = len(prompt) * cfg.vocab_size * 4 // 2  # as if the budget were smaller
    outs = finish(engine, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1), prompt)
    assert handed_back == [1]
    assert len(outs[0].prompt_logprobs) == len(prompt)  # the answer is whole
