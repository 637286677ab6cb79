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
    """Engines on exact fp32 activations unless a test asks for int8: the outputs these tests expect
    are the reference's (dequantize-then-multiply). tests/engine/test_int8_activations.py runs the
    default, int8."""
    def make(**kwargs: object) -> LLMEngine:
        return LLMEngine.from_config(EngineConfig.from_kwargs(**{"activation_dtype": "float32", **kwargs}),
                                     default_model)

    return make
