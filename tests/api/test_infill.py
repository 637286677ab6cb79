"""Fill in the middle (`suffix` on /v1/completions) on a code model trained for it,
Qwen2.5-Coder-0.5B-Instruct, through an in-process app over the real engine."""
from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import in_process_app


MODEL = "qwen2.5-coder-0.5b"
COMPLETIONS = "/v1/completions"
PREFIX = "def area_of_circle(radius):\n    "
SUFFIX = "\n\n\nprint(area_of_circle(2.0))\n"


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    for client, _ in in_process_app(MODEL, num_kv_blocks=64, max_num_seqs=4):
        yield client


def complete(http: TestClient, **fields: Any) -> dict[str, Any]:
    reply = http.post(COMPLETIONS, json={"model": MODEL, "max_tokens": 48, "temperature": 0, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_middle_is_what_the_model_writes_between_prefix_and_suffix(http: TestClient) -> None:
    from conveyor.model.loader import load_tokenizer

    tokenizer = load_tokenizer(MODEL)
    fim = tokenizer.infill
    assert fim is not None
    infilled = complete(http, prompt=PREFIX, suffix=SUFFIX)
    choice = infilled["choices"][0]
    # It fills the body in and ends at the model's end of text, not at max_tokens.
    assert choice["text"].startswith("return ") and "radius" in choice["text"].splitlines()[0], choice
    assert choice["finish_reason"] == "stop"
    # The same as the prompt Tokenizer.encode_infill lays out, sent as ids with the same stops.
    ids = tokenizer.encode_infill(PREFIX, SUFFIX)
    assert infilled["usage"]["prompt_tokens"] == len(ids)
    by_ids = complete(http, prompt=ids, stop_token_ids=list(fim.ends))
    assert by_ids["choices"][0]["text"] == choice["text"]
    # Without the suffix the model writes something else: the suffix reached it.
    assert complete(http, prompt=PREFIX)["choices"][0]["text"] != choice["text"]


def test_streamed_and_batched_middles_match(http: TestClient) -> None:
    whole = complete(http, prompt=PREFIX, suffix=SUFFIX)["choices"][0]["text"]
    with http.stream("POST", COMPLETIONS, json={"model": MODEL, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 48,
                                                "temperature": 0, "stream": True}) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    two = complete(http, prompt=[PREFIX, "import math\n\n" + PREFIX], suffix=SUFFIX)
    assert len(two["choices"]) == 2 and two["choices"][0]["text"] == whole


def test_truncation_cuts_the_ends_farthest_from_the_middle(http: TestClient) -> None:
    cut = complete(http, prompt="# " + "long preamble " * 100 + "\n" + PREFIX, suffix=SUFFIX * 20,
                   truncate_prompt_tokens=40, max_tokens=4)
    assert cut["usage"]["prompt_tokens"] == 40
    as_float = complete(http, prompt="# " + "long preamble " * 100 + "\n" + PREFIX, suffix=SUFFIX * 20,
                        truncate_prompt_tokens=40.0, max_tokens=4)  # JSON's 40.0 is 40
    assert as_float["usage"]["prompt_tokens"] == 40
    refused = http.post(COMPLETIONS, json={"model": MODEL, "prompt": PREFIX, "suffix": SUFFIX, "truncate_prompt_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens", refused.text
