"""Smoke runs on the real default model: `bench compare` in-process and `bench serve` against
`conveyor serve`. Tiny workloads: these check the plumbing and the files, not the figures."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.cli import main
from conveyor.model.threads import get_num_threads, set_num_threads

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def one_thread() -> object:
    """One thread a step: on a shared 2-core machine two OpenMP threads can be ~30x slower per step."""
    before = get_num_threads()
    yield
    set_num_threads(before)


@pytest.mark.usefixtures("smollm_gguf_path", "one_thread")
def test_bench_compare_writes_table_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "compare"
    code = main(["bench", "compare", "--dataset", "uniform", "--num-prompts", "4", "--input-len", "12",
                 "--output-len", "3", "--max-num-seqs", "2", "--kv-cache-memory", "32MiB", "--chunk-size", "8",
                 "--request-rate", "inf", "--num-threads", "1", "--output-dir", str(out), "--disable-tqdm",
                 "--no-warmup"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "x static" in printed and "continuous-chunked" in printed
    for name in ("table.txt", "compare.json", "occupancy.png", "itl_over_time.png", "latency_cdf.png", "vs_rate.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "compare.json").read_text())
    runs = {run["policy"]: run for run in data["runs"]}
    assert set(runs) == {"static", "continuous-naive", "continuous-chunked"}
    for run in runs.values():
        assert run["completed"] == 4 and run["output_lens"] == [3, 3, 3, 3] and run["request_rate"] == "inf"
        assert max(run["trace"]["running"]) <= 2 and run["mean_ttft_ms"] > 0
    assert runs["continuous-naive"]["engine"]["chunked_prefill"] is False
    assert runs["continuous-chunked"]["engine"]["max_num_batched_tokens"] == 8
    assert max(runs["continuous-chunked"]["trace"]["num_tokens"]) <= 8
    assert max(runs["static"]["trace"]["held"]) == 2


@pytest.mark.usefixtures("smollm_gguf_path", "one_thread")
def test_bench_steps_runs_activation_dtypes_back_to_back(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "steps", "--activation-dtypes", "int8", "float32", "--prefill", "40", "--batch-sizes", "2",
                 "--contexts", "8", "--steps", "2", "--repeats", "1", "--num-threads", "1"])
    assert code == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.count("|") >= 5]
    table = {(row[0].strip(), row[1].strip()): row for row in rows[1:]}
    assert set(table) == {("p40", "int8"), ("p40", "float32"), ("2", "int8"), ("2", "float32")}
    assert table[("2", "int8")][5].strip() == "1.00x" and table[("p40", "int8")][5].strip().startswith("1.00x")
    assert "prompt tok/s" in table[("p40", "float32")][5]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.usefixtures("smollm_gguf_path")
def test_bench_serve_against_conveyor_serve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli", "serve", "--port", str(port), "--max-num-seqs", "4",
         "--kv-cache-memory", "32MiB", "--served-model-name", "smollm2-135m", "--log-level", "warning"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    try:
        result = tmp_path / "serve.json"
        code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "smollm2-135m",
                     "--dataset", "random", "--num-prompts", "4", "--input-len", "12", "--output-len", "4",
                     "--request-rate", "50", "--goodput", "ttft:60000", "--save-result", str(result),
                     "--disable-tqdm", "--ready-timeout", "90"])
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    printed = capsys.readouterr().out
    assert code == 0, (tmp_path / "server.log").read_text()[-2000:]
    assert "============ Serving Benchmark Result ============" in printed
    assert "Request goodput (req/s):" in printed
    saved = json.loads(result.read_text())
    assert saved["completed"] == 4 and saved["failed"] == 0
    assert saved["output_lens"] == [4, 4, 4, 4]  # ignore_eos: exactly max_tokens, from the usage chunk
    assert saved["total_input_tokens"] == 48 and all(t > 0 for t in saved["ttfts"])
    assert saved["request_goodput"] is not None and saved["p99_itl_ms"] > 0
