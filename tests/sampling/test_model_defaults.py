"""What a request that leaves a sampling field out gets (model_defaults): the model's recommendation
by --generation-config, less a value no request could take, which is named in a warning."""
from __future__ import annotations

import json
import logging

import pytest

from conveyor.sampling.params import SamplingParams, model_defaults


def test_a_value_no_request_could_take_is_left_out_and_named(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        checked = model_defaults("auto", {"temperature": 0.6, "top_p": 0.0, "max_tokens": 0, "top_k": 20})
    assert checked == {"temperature": 0.6, "top_k": 20}
    assert "top_p = 0.0" in caplog.text and "max_tokens = 0" in caplog.text  # each refused one named
    assert "temperature 0.6, top_k 20" in caplog.text  # and what applies, as vLLM logs it
    SamplingParams(**checked)


def test_vllm_and_a_folder(tmp_path) -> None:
    assert model_defaults("vllm", {"temperature": 0.6}) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 40, "max_new_tokens": 512}))
    assert model_defaults(str(tmp_path), {"temperature": 0.6}) == {"top_k": 40, "max_tokens": 512}
