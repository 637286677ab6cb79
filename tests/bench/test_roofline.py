from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.bench.roofline import fit_knee
from conveyor.cli import main


def test_fit_knee_of_an_ideal_roofline():
    # Flat at 30 ms until batch 16, then 1.875 ms per request: the knee is at 16.
    batches = [1, 2, 4, 8, 16, 32, 64]
    step_s = [max(0.030, b * 0.030 / 16) for b in batches]
    assert fit_knee(batches, step_s) == pytest.approx(16.0)


@pytest.mark.usefixtures("smollm_gguf_path")
@pytest.mark.parametrize("weights", ["gguf-blocks", "dense-fp32"])
def test_roofline_command_on_the_real_model(tmp_path: Path, capsys: pytest.CaptureFixture[str], weights: str) -> None:
    dense = ["--dequantize-weights"] if weights == "dense-fp32" else []
    code = main(["bench", "roofline", "--batch-sizes", "1", "4", "--context", "16", "--steps", "2",
                 "--num-threads", "1", "--output-dir", str(tmp_path), *dense])
    assert code == 0
    printed = capsys.readouterr().out
    assert "predicted knee: batch" in printed and "measured knee: batch" in printed
    result = json.loads((tmp_path / "roofline.json").read_text())
    assert result["batches"] == [1, 4] and all(ms > 0 for ms in result["step_ms"])
    # 30 layers of SmolLM2-135M plus the vocabulary projection, ~269 MFLOP per token: about 538 MB
    # in fp32, 96 MB as the GGUF's Q4_1 projections and Q8_0 head.
    low, high = (500e6, 580e6) if dense else (90e6, 100e6)
    assert low < result["weight_bytes"] < high and 250e6 < result["flops_per_token"] < 290e6
    assert (tmp_path / "roofline.png").stat().st_size > 10_000
