"""Session-wide fixtures: the shipped default model, ours and transformers' reference for it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import SMOLLM_GGUF_NAME, gguf_parsed_once, hf_gguf_tokenizer


@pytest.fixture(scope="session")
def smollm_gguf_path() -> Path:
    from conveyor.errors import ModelLoadError
    from conveyor.model.loader import resolve_model_path

    try:
        return resolve_model_path(None)
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def default_checkpoint(smollm_gguf_path: Path) -> Any:
    """The default model with every weight dequantized to fp32 (what the references compare)."""
    from conveyor.model.loader import load_checkpoint

    return load_checkpoint(str(smollm_gguf_path), dtype="float32", keep_blocks=False)


@pytest.fixture(scope="session")
def hf_reference_model(smollm_gguf_path: Path) -> Any:
    import torch  # the reference only: transformers runs on torch
    from transformers import AutoModelForCausalLM

    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(
            smollm_gguf_path.parent, gguf_file=SMOLLM_GGUF_NAME, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def hf_reference_tokenizer(smollm_gguf_path: Path) -> Any:
    return hf_gguf_tokenizer()


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same random state, whichever tests ran before it in its worker
    (make test spreads files over pytest-xdist workers in an order that varies run to run)."""
    import random
    import sys

    import numpy as np

    random.seed(0)
    np.random.seed(0)
    if "torch" in sys.modules:  # the sampler's generators, and the references', where torch is loaded
        sys.modules["torch"].manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _built_kernels() -> None:
    """Build the C++ kernels once, in this process, before any test starts a server or a Ray
    worker: a cold build takes ~30 s, which must not land inside a subprocess's start-up timeout."""
    from conveyor.model.kernels import build_kernels

    build_kernels()
