"""The app over the real Qwen2.5-Coder-0.5B-Instruct, in this process, as module fixtures: a test
module imports `app` and `http` (one app per module that does; tests/api/conftest.py's
in_process_app) to test an API on a real model that renders tools and infills code."""
from __future__ import annotations

from typing import Any, Iterator

import pytest

from tests.api.conftest import in_process_app

MODEL = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="module")
def app() -> Iterator[tuple[Any, Any]]:
    """(TestClient, ServerState): 96 KV blocks, 4 sequences, 512 tokens a request."""
    yield from in_process_app(MODEL, num_kv_blocks=96, max_num_seqs=4, max_model_len=512)


@pytest.fixture(scope="module")
def http(app: tuple[Any, Any]) -> Any:
    return app[0]
