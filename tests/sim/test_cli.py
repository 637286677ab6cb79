"""`conveyor simulate` from the command line."""
from __future__ import annotations

import json

import pytest

from conveyor.cli import main


def test_simulate_prints_the_bench_block_and_writes_compare_outputs(tmp_path, capsys) -> None:  # noqa: ANN001
    code = main(["simulate", "--hardware", "h100", "--model", "llama-3-8b", "--workload", "chat", "--rate", "10",
                 "--policy", "continuous", "--num-prompts", "30", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "Serving Benchmark Result" in out and "Successful requests:                     30" in out
    assert "Request rate configured (RPS):           10.00" in out
    data = json.loads((tmp_path / "sim.json").read_text())
    run = data["runs"][0]
    assert run["completed"] == 30 and run["engine"]["max_num_seqs"] == 256
    assert len(run["trace"]["t"]) == run["num_steps"] and len(run["ttfts"]) == 30
    assert (tmp_path / "table.txt").exists() and (tmp_path / "latency_cdf.png").exists()


def test_simulate_rate_sweep(capsys) -> None:  # noqa: ANN001
    code = main(["simulate", "--hardware", "l4", "--model", "smollm2-135m", "--dataset", "uniform",
                 "--input-len", "64", "--output-len", "32", "--num-prompts", "40", "--sweep", "rate",
                 "--sweep-values", "1", "1000", "--slo", "ttft:200"])
    out = capsys.readouterr().out
    assert code == 0 and "highest rate meeting P99 TTFT <= 200 ms: 1" in out


def test_scheduler_knobs_reach_the_engine_config() -> None:
    import argparse

    from conveyor.sim.cli import _engine_kwargs, add_simulate_parser

    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--no-chunked-prefill", "--max-num-batched-tokens", "4096",
                              "--policy", "static", "--block-size", "32", "--no-enable-prefix-caching",
                              "--no-window-kv-pool"])
    assert _engine_kwargs(args) == {"policy": "static", "max_num_seqs": 256, "max_num_batched_tokens": 4096,
                                    "chunked_prefill": False, "block_size": 32, "enable_prefix_caching": False,
                                    "window_kv_pool": False}


def test_bad_hardware_and_sweep_without_slo_fail_clearly(capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit):
        main(["simulate", "--hardware", "tpu"])
    with pytest.raises(SystemExit, match="--slo"):
        main(["simulate", "--num-prompts", "2", "--sweep", "rate"])
    assert main(["simulate", "--model", "llama-3-70b", "--num-prompts", "2"]) == 2  # does not fit one H100
    assert "--tp" in capsys.readouterr().err
