"""The decoder's MLP in runs of rows: the same bits as one product of all rows, on the real model."""
from __future__ import annotations

from typing import Any

import pytest

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.model import llama, memory
from conveyor.model.linear import PromptRows, matmul_path
from conveyor.runner.model_runner import LoadedModel, load_model
from conveyor.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def smollm() -> LoadedModel:
    return load_model(EngineConfig())


def test_a_step_s_rows_split_into_runs_of_at_most_mlp_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    matmul = matmul_path("int8")
    assert llama.mlp_row_parts(300, matmul, "int8", None) == [(0, 300, matmul)]
    monkeypatch.setattr(memory, "MLP_ROWS", 64)
    parts = llama.mlp_row_parts(300, matmul, "int8", None)
    assert [(start, end) for start, end, _ in parts] == [(0, 64), (64, 128), (128, 192), (192, 256), (256, 300)]
    assert llama.mlp_row_parts(64, matmul, "int8", None) == [(0, 64, matmul)]


def test_each_run_s_product_takes_its_own_prompt_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where prompt rows take the bf16 tiles (AMX), a run's product must know which of its rows are
    # prompt rows, numbered from the run's start; the whole step's would send them all to int8.
    asked: list[PromptRows | None] = []

    def recording_path(activation_dtype: str = "float32", prompt_rows: PromptRows | None = None) -> object:
        asked.append(prompt_rows)
        return matmul_path(activation_dtype, prompt_rows)

    monkeypatch.setattr(llama, "matmul_path", recording_path)
    monkeypatch.setattr(memory, "MLP_ROWS", 64)
    step = PromptRows.of(((0, 100), (150, 170)), 200)  # two prompts' rows, generated rows between
    assert step is not None
    parts = llama.mlp_row_parts(200, matmul_path("int8", step), "int8", step)
    assert [(start, end) for start, end, _ in parts] == [(0, 64), (64, 128), (128, 192), (192, 200)]
    assert asked == [PromptRows(64, ((0, 64),), ()), PromptRows(64, ((0, 36),), ((36, 64),)),
                     PromptRows(64, ((22, 42),), ((0, 22), (42, 64))), None]


def test_prompt_rows_within_a_run_are_numbered_from_its_start() -> None:
    rows = PromptRows.of(((10, 70), (100, 130)), 140)
    assert rows is not None
    assert rows.within(0, 64) == PromptRows(64, ((10, 64),), ((0, 10),))
    assert rows.within(64, 128) == PromptRows(64, ((0, 6), (36, 64)), ((6, 36),))
    assert rows.within(128, 140) == PromptRows(12, ((0, 2),), ((2, 12),))
    assert rows.within(70, 100) is None  # generated rows only: the int8 product


def _prompt_and_greedy(engine: LLMEngine, ids: list[int]) -> tuple[Any, list[int], list[Any]]:
    engine.add_request(ids, SamplingParams(max_tokens=8, temperature=0, logprobs=5, prompt_logprobs=5))
    prompt_logprobs, tokens, logprobs = None, [], []
    while engine.has_unfinished_requests:
        for out in engine.step():
            prompt_logprobs = prompt_logprobs or out.prompt_logprobs
            tokens += out.new_token_ids
            logprobs += out.logprobs or []
    return prompt_logprobs, tokens, logprobs


@pytest.mark.parametrize("activation_dtype", ["int8", "float32"])
def test_a_prefill_s_mlp_in_runs_of_rows_gives_the_same_bits(smollm: LoadedModel, activation_dtype: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine.from_config(EngineConfig.from_kwargs(activation_dtype=activation_dtype,
                                                            enable_prefix_caching=False), smollm)
    text = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n" * 14
    ids = engine.tokenizer.encode(text)
    assert 256 < len(ids) < memory.MLP_ROWS  # one prefill step, its MLP one run by default
    whole = _prompt_and_greedy(engine, ids)
    monkeypatch.setattr(memory, "MLP_ROWS", 64)  # five runs, the last a short one
    runs = _prompt_and_greedy(engine, ids)
    assert whole[0] is not None and len(whole[0]) == len(ids)
    assert runs == whole
