"""Speculative decoding with a draft model: the draft only proposes, so outputs never change."""
from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.config import EngineConfig, SpeculativeConfig
from conveyor.engine.llm import LLM
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import ConfigError
from conveyor.sampling.params import SamplingParams
from tests.helpers import make_tiny_hf_checkpoint

PROMPTS = ["Repeat this list exactly: apple, banana, cherry, date, elderberry, fig. Again: apple, banana,",
           "def fibonacci(n):"]


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights on SmolLM2's vocabulary: proposals nearly always wrong."""
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("draft"))


def generate(default_model: object, spec: dict | None, params: SamplingParams) -> tuple[list[list[int]], LLMEngine]:
    config = EngineConfig.from_kwargs(activation_dtype="float32", kv_cache_dtype="float32", num_kv_blocks=128,
                                      max_model_len=512,
                                      speculative_config=spec)
    engine = LLMEngine.from_config(config, default_model)
    outputs = LLM.from_engine(engine).generate(PROMPTS, params)
    return [o.token_ids for o in outputs], engine


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40, temperature=0.0),
                                    SamplingParams(max_tokens=40, temperature=0.9, top_k=20, seed=7)],
                         ids=["greedy", "seeded"])
def test_a_draft_model_changes_no_output(default_model, tiny_draft: Path, params: SamplingParams) -> None:
    expected, _ = generate(default_model, None, params)
    # A wrong draft (random weights) and a perfect one (the served model itself, as its own draft).
    wrong, engine = generate(default_model, {"model": str(tiny_draft), "num_speculative_tokens": 4,
                                             "adaptive": False}, params)
    assert wrong == expected
    assert engine.speculator is not None and engine.speculator.num_draft_tokens > 0
    perfect, engine = generate(default_model, {"method": "draft_model", "model": "smollm2-135m",
                                               "num_speculative_tokens": 4, "adaptive": False}, params)
    assert perfect == expected
    speculator = engine.speculator
    # The draft proposes its greedy tokens: a sampled target agrees with them less often.
    agreement = 0.6 if params.greedy else 0.2
    assert speculator is not None and speculator.num_accepted_tokens > agreement * speculator.num_draft_tokens
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_a_draft_must_share_the_vocabulary_and_be_named(default_model, tmp_path: Path) -> None:
    other = make_tiny_hf_checkpoint(tmp_path, vocab_size=50000)
    with pytest.raises(ConfigError, match="vocabulary"):
        generate(default_model, {"model": str(other)}, SamplingParams(max_tokens=2))
    with pytest.raises(ConfigError, match="model"):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ConfigError, match="model"):
        SpeculativeConfig.parse('{"method": "ngram", "model": "x"}')
    assert SpeculativeConfig.parse('{"model": "x"}').method == "draft_model"  # vLLM's way of asking

