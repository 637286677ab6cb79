"""An engine builds every C++ kernel its model runs while it is built: a first request after the
server says "ready" must not wait for a compiler."""
from __future__ import annotations

import pytest

from conveyor.model import kernels
from conveyor.sampling.params import SamplingParams


def test_a_step_resolves_no_kernel_that_building_the_engine_did_not(make_engine,  # noqa: ANN001
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    built = kernels._load
    asked: list[str] = []

    def recording(name: str) -> object | None:
        asked.append(name)
        return built(name)

    monkeypatch.setattr(kernels, "_load", recording)
    engine = make_engine(max_num_seqs=2)
    at_build = set(asked)
    # fp32 runs all six (the integer kernel for --activation-dtype int8 is built beside quant_gemm)
    assert at_build == {"paged_decode", "paged_prefill", "fused_ops", "panel_gemm", "quant_gemm", "quant_int8"}
    asked.clear()
    engine.add_request([11, 12, 13, 14], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests:
        engine.step()
    assert asked and set(asked) <= at_build  # prefill and decode steps, nothing new
