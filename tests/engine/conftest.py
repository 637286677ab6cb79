from __future__ import annotations

import pytest

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.runner.model_runner import LoadedModel, load_model


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The default model (SmolLM2-135M, fp32) loaded once; engines built from it share the weights."""
    return load_model(EngineConfig())


@pytest.fixture(scope="session")
def make_engine(default_model: LoadedModel):
    """Engines on exact fp32 activations and an fp32 KV cache unless a test asks otherwise: the
    outputs these tests expect are the reference's (dequantize-then-multiply), and equal across
    paths that compute the same keys in different batches. tests/engine/test_int8_activations.py
    runs int8, tests/engine/test_kv_cache_dtype.py the float16 cache."""
    def make(**kwargs: object) -> LLMEngine:
        exact = {"activation_dtype": "float32", "kv_cache_dtype": "float32"}
        return LLMEngine.from_config(EngineConfig.from_kwargs(**{**exact, **kwargs}),
                                     default_model)

    return make
