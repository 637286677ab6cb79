"""Bad command-line input ends in one line naming what is wrong (exit status 2), never a traceback
or a run that hangs or measures nothing."""
from __future__ import annotations

import pytest

from conveyor.cli import main


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--num-prompts", "3", "--rate", "nan"], "request rate must be positive"),
    (["simulate", "--num-prompts", "3", "--input-len", "100000"], "every one of the 3 requests was refused"),
    (["simulate", "--num-prompts", "3", "--input-len", "100000", "--prefill-workers", "1", "--decode-workers", "1"],
     "every one of the 3 requests was refused"),
    (["simulate", "--num-prompts", "0"], "num_prompts must be positive"),
    (["simulate", "--num-prompts", "2", "--output-len", "-3"], "output_len -3"),
    (["simulate", "--num-prompts", "2", "--dataset", "multi-turn", "--think-time", "nan"], "think_time"),
    (["simulate", "--num-prompts", "2", "--sweep", "rate", "--slo", "ttft:abc"], "SLOs are KEY:MS"),
    (["simulate", "--num-prompts", "2", "--metric-percentiles", "50,150"], "percentiles are numbers from 0 to 100"),
    (["simulate", "--num-prompts", "2", "--output-dir", __file__], "File exists"),
    (["generate", "--num-threads", "0", "x"], "num_threads must be positive"),
    (["generate", "--num-kv-blocks", "0", "x"], "num_kv_blocks must be positive"),
    (["generate", "--seed", str(2**70), "x"], "seed must be in [0, 2**64)"),
    (["bench", "serve", "--model", "m", "--base-url", "notaurl", "--num-prompts", "1"], "base_url must be an http"),
    (["bench", "serve", "--model", "m", "--max-concurrency", "0", "--num-prompts", "1"], "max_concurrency must be at least 1"),
    (["simulate", "--num-prompts", "2", "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
    (["simulate", "--num-prompts", "2", "--tp", "3"], "tensor parallel size 3 does not divide"),
    (["simulate", "--num-prompts", "2", "--num-kv-blocks", "1000000000"], "more than the simulator tracks"),
    (["simulate", "--num-prompts", "2", "--max-model-len", "1000000"], "is over llama-3-8b's context length"),
    (["simulate", "--num-prompts", "2", "--hardware", "l4", "--kv-cache-memory", "1TB"], "more than 1 x l4 hold"),
    (["simulate", "--num-prompts", "2", "--prefill-workers", "1", "--decode-workers", "1",
      "--kv-transfer-bandwidth", "0"], "kv_transfer_bandwidth must be a positive"),
    (["serve", "smollm2-135m", "--model", "gemma3-270m"], "two models given"),
    (["serve", "--api-key", " "], "--api-key (or CONVEYOR_API_KEY) is empty"),
    (["serve", "--served-model-name", ""], "--served-model-name is empty"),
    (["export-hf", ""], "the output folder is empty"),
    (["simulate", "--num-prompts", "2", "--slo", "ttft:500"], "--slo and --sweep-values are for --sweep"),
    (["simulate", "--num-prompts", "2", "--spec-acceptance", "0.5"], "--spec-acceptance is for a run with"),
    (["simulate", "--num-prompts", "2", "--sweep", "max-num-seqs", "--sweep-values", "2.5", "--slo", "tpot:50"],
     "whole caps of at least 1"),
    (["simulate", "--num-prompts", "2", "--dataset", "edit"], "run it with `conveyor bench`"),
    (["simulate", "--num-prompts", "2", "--profile", "p.json"], "--profile is the profiled cost model's"),
    (["simulate", "--num-prompts", "2", "--hardware", "h100-sxm", "--roofline-json", "r.json"],
     "--roofline-json describes this machine"),
])
def test_bad_input_is_one_line_naming_it(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("conveyor: error: ") and message in err[0], err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--speculative-config", '{"method": "eagle"}', "x"], "speculative_config.method 'eagle' is not available"),
    (["serve", "--port", "70000"], "a port is 0-65535"),
    (["bench", "quality", "--max-tokens", "-1"], "--max-tokens: must be at least 2"),
    (["bench", "steps", "--repeats", "0"], "--repeats: must be at least 1"),
    (["bench", "steps", "--contexts", "0"], "--contexts: must be at least 1"),
    (["simulate", "fit", "--batch-sizes", "-1"], "--batch-sizes: must be at least 1"),
    (["serve", "--max-waiting-requests", "0"], "--max-waiting-requests: must be at least 1"),
    (["serve", "--max-request-bytes", "5"], "--max-request-bytes: must be at least 1024"),
    (["serve", "--allowed-origins", "models/x.gguf"], "'models/x.gguf' is not an origin"),
    (["serve", "--allowed-origins", "http://a.example/path"], "no path"),
    (["serve", "--allowed-origins", '["*"'], "not a JSON list"),
])
def test_a_flag_parsed_by_argparse_says_what_is_wrong_with_it(argv: list[str], message: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_allowed_origins_take_a_list_in_one_argument_as_vllm_does() -> None:
    from conveyor.cli import _origins

    assert _origins("http://a.example, https://b.example:8443") == ["http://a.example", "https://b.example:8443"]
    assert _origins('["*"]') == ["*"] and _origins("") == [] and _origins("[]") == []


def test_serve_refuses_an_address_it_cannot_listen_on_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    assert main(["serve", "--host", "999.1.1.1"]) == 2
    assert "--host '999.1.1.1' does not resolve" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err
