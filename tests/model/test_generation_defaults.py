"""The sampling a model's files recommend: generation_config.json (vLLM's fields, transformers'
defaults left out), a GGUF's general.sampling.* keys (llama.cpp's), and --generation-config's
choices; on the real default model's GGUF metadata and on an HF folder."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from conveyor.config import EngineConfig
from conveyor.errors import ConfigError
from conveyor.model.generation_defaults import from_generation_config, from_gguf_metadata, recommended_sampling
from conveyor.model.gguf_loader import read_gguf
from conveyor.model.loader import resolve_model_path
from conveyor.model.tokenizer import Tokenizer
from tests.helpers import make_tiny_hf_checkpoint

QWEN_GENERATION_CONFIG = {  # what Qwen2.5-Coder-0.5B-Instruct's own generation_config.json says
    "bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"}


def test_generation_config_fields_vllm_reads_and_only_where_they_differ_from_transformers_defaults() -> None:
    assert from_generation_config(QWEN_GENERATION_CONFIG) == {
        "repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    # transformers' own defaults recommend nothing; max_new_tokens is SamplingParams' max_tokens
    assert from_generation_config({"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0,
                                   "max_new_tokens": 256, "min_p": 0.05}) == {"max_tokens": 256, "min_p": 0.05}
    assert from_generation_config({"do_sample": False, "eos_token_id": 2, "max_length": 20}) == {}


def test_a_value_that_is_not_a_number_is_reported_not_applied(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert from_generation_config({"temperature": "hot", "top_p": True, "top_k": 5}) == {"top_k": 5}
    assert "temperature" in caplog.text and "top_p" in caplog.text


def test_the_real_models_gguf_with_llama_cpps_sampling_keys(caplog: pytest.LogCaptureFixture) -> None:
    meta = dict(read_gguf(resolve_model_path(None)).metadata)
    assert Tokenizer.from_gguf(meta).recommended_sampling == {}  # the shipped file recommends nothing
    meta.update({"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.top_p": 0.95,
                 "general.sampling.min_p": 0.0, "general.sampling.penalty_repeat": 1.1,
                 "general.sampling.penalty_last_n": 64})
    with caplog.at_level(logging.INFO):
        tokenizer = Tokenizer.from_gguf(meta)
    assert tokenizer.recommended_sampling == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0}
    # llama.cpp's penalty counts the last n tokens, conveyor's the whole sequence: said, not applied
    assert "general.sampling.penalty_repeat" in caplog.text
    assert from_gguf_metadata({"general.sampling.temp": "x"}) == {}


def test_an_hf_folders_generation_config_reaches_its_tokenizer(tmp_path: Path) -> None:
    folder = make_tiny_hf_checkpoint(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({**QWEN_GENERATION_CONFIG, "eos_token_id": [5, 6]}))
    tokenizer = Tokenizer.from_hf_folder(folder)
    assert tokenizer.recommended_sampling == {"repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert {5, 6} <= set(tokenizer.eos_token_ids)  # its eos ids are still read from it


def test_the_choices_auto_vllm_and_a_folder(tmp_path: Path) -> None:
    model = {"temperature": 0.7}
    assert recommended_sampling("auto", model) == model
    assert recommended_sampling("vllm", model) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "max_new_tokens": 9}))
    assert recommended_sampling(str(tmp_path), model) == {"top_p": 0.5, "max_tokens": 9}
    with pytest.raises(ConfigError, match="generation_config must be one of"):  # refused before any load
        EngineConfig(generation_config=str(tmp_path / "nothing"))
    (tmp_path / "generation_config.json").write_text("[1, 2")
    with pytest.raises(ConfigError, match="cannot read"):
        recommended_sampling(str(tmp_path), model)
