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
    (["generate", "--num-threads", "0", "x"], "--num-threads must be positive"),
    (["generate", "--num-kv-blocks", "0", "x"], "--num-kv-blocks must be positive"),
    (["generate", "--seed", str(2**70), "x"], "seed must be in [0, 2**64)"),
    (["bench", "serve", "--model", "m", "--base-url", "notaurl", "--num-prompts", "1"], "base_url must be an http"),
    # vLLM's bench spellings: the address from --host / --port, the random dataset's lengths
    (["bench", "serve", "--model", "m", "--port", "1", "--random-input-len", "8", "--random-output-len", "4",
      "--num-prompts", "1", "--ready-timeout", "0.5", "--disable-tqdm"], "http://127.0.0.1:1/v1/models did not answer"),
    (["bench", "serve", "--model", "m", "--max-concurrency", "0", "--num-prompts", "1"], "max_concurrency must be at least 1"),
    (["simulate", "--num-prompts", "2", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
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
    # vLLM's command lines: its GPU flags say what does their work here
    (["generate", "--gpu-memory-utilization", "0.9", "x"], "--gpu-memory-utilization: size the KV pool with "
                                                            "--kv-cache-memory"),
    (["generate", "--tensor-parallel-size", "2", "x"], "--tensor-parallel-size: one engine uses --num-threads"),
    (["generate", "--no-enforce-eager", "x"], "--enforce-eager: there are no graphs to capture on a CPU"),
    (["generate", "--tokenizer", "t", "x"], "['--tokenizer'] (--tokenizer: the tokenizer comes from the model's"),
    (["generate", "--runner", "draft", "x"], "--runner: one engine generates and serves /v1/embeddings"),
    (["generate", "--generation-config", "/nonexistent", "x"], "--generation-config must be one of ('auto', 'vllm')"),
    (["generate", "--top-p", "2", "x"], "top_p must be in (0, 1]"),  # before the model loads
    (["serve", "--chat-template", "/nonexistent.jinja"], "is neither a file nor a Jinja template"),
    (["serve", "--chat-template", "{% if %}"], "--chat-template: the chat template does not compile"),
    (["serve", "--worker-cpus", "2"], "--worker-cpus applies to Ray workers"),
    (["serve", "--max-log-len", "10"], "--max-log-len cuts the lines --enable-log-requests writes"),
    # vLLM's --served-model-name takes every word after it: a model given after them is caught
    (["serve", "--served-model-name", "a", "b", "qwen2.5-coder-0.5b"], "took 'qwen2.5-coder-0.5b', which is a model"),
    (["serve", "--served-model-name", "a", "Qwen/Qwen2.5-0.5B-Instruct"], "took 'Qwen/Qwen2.5-0.5B-Instruct'"),
    (["serve", "--served-model-name", "a", "typo.gguf"], "took 'typo.gguf', which is a model"),
    (["serve", "--ray-address", "127.0.0.1:1"], "cannot reach the Ray cluster at '127.0.0.1:1'"),  # not minutes
    (["serve", "--routing", "least-load", "--worker-cpus", "2"], "--worker-cpus and --routing apply to Ray"),
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
    (["serve", "--shutdown-timeout", "nan"], "a number of seconds, 0 or more"),
    (["serve", "--port", "abc"], "invalid port value: 'abc'"),
    (["serve", "--max-model-len", "4q"], "a whole number of tokens (4096, 4k, 4K), got '4q'"),
    (["serve", "--tool-call-parser", "mistral"], "invalid choice: 'mistral'"),
    (["serve", "--enable-log-requests", "--disable-log-requests"], "not allowed with argument --enable-log-requests"),
    (["serve", "--enable-log-requests", "--max-log-len", "-1"], "a count, 0 or more, got -1"),
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


def test_generate_without_prompts_says_so_before_loading(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("\n  \n"))
    assert main(["generate"]) == 2
    assert "no prompts: give them as arguments, or one a line on stdin" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\r\n"))  # a Windows line ending is not the prompt's
    assert main(["generate", "--max-tokens", "1"]) == 0
    assert "### 'Hi'" in capsys.readouterr().out


def test_a_max_model_len_beyond_the_kv_cache_is_refused_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--num-kv-blocks", "4", "--max-model-len", "100", "x"]) == 2
    assert "--max-model-len 100 is more tokens than the KV cache holds (64)" in capsys.readouterr().err


def test_a_truncated_gguf_is_called_truncated(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.model.loader import resolve_model_path

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(resolve_model_path(None).read_bytes()[:200_000])  # inside the vocabulary's metadata
    assert main(["generate", "--model", str(cut), "x"]) == 2
    assert "it ends inside its header, so it is truncated" in capsys.readouterr().err


def test_a_vllm_command_line_runs(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    import logging

    # The flags vLLM users write that say what conveyor does anyway
    with caplog.at_level(logging.WARNING):
        assert main(["generate", "--dtype", "auto", "--tensor-parallel-size", "1", "--trust-remote-code",
                     "--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "512", "--runner", "pooling",
                     "--max-tokens", "2", "Hi"]) == 0
    assert "1 requests, 2 tokens" in capsys.readouterr().out
    assert "max_model_len 512: the tokens one step computes without chunked prefill" in caplog.text  # it took


def test_an_inline_chat_template_of_real_length_is_taken() -> None:
    from conveyor.cli import _chat_template

    template = "{% for message in messages %}" + "{{ message['role'] }}: {{ message['content'] }}\n" * 12 + \
        "{% endfor %}"
    assert len(template) > 300 and _chat_template(template) == template  # no file name is that long


def test_ctrl_c_while_the_model_loads_exits_130_without_a_traceback() -> None:
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "serve", "--port", "0"],
                            cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # the load begins: the weights, the KV pool and the warm-up are still to come
        lines.append(line)
        if "loading model" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=120)
    output = "".join(lines) + rest
    assert proc.returncode == 130, output
    assert "conveyor: interrupted" in output and "Traceback" not in output and "terminate" not in output


def test_vllm_serving_flags_are_taken(tmp_path) -> None:
    from tests.api.conftest import httpx, start_server

    srv = start_server("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-log-requests",
                       "--max-log-len", "3", "--disable-uvicorn-access-log", "--uvicorn-log-level", "info",
                       "--log-level", "info")
    body = {"prompt": "Once upon a time there was", "max_tokens": 2, "temperature": 0}
    try:
        assert httpx.get(f"{srv.base_url}/health").status_code == 200
        reply = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=60.0).json()
    finally:
        srv.stop()
    log = srv.log()
    assert "Uvicorn running on" in log
    assert "GET /health" not in log  # no access log
    # Each prompt cut to 3 characters and 3 token ids, as vLLM's --max-log-len cuts them.
    from conveyor.model.loader import load_tokenizer

    ids = load_tokenizer(None).encode(body["prompt"])
    line = next(line for line in log.splitlines() if "Received request" in line)
    assert f"Received request {reply['id']}-0: prompt: 'Onc', params: SamplingParams(" in line, line
    assert f"prompt_token_ids: {ids[:3]} ... ({len(ids)} in all)" in line and "temperature=0" in line, line


def test_vllm_spellings_of_flags_and_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"conveyor {__version__}"
    assert main(["generate", "--max_tokens=2", "--num_kv_blocks", "64", "Hi"]) == 0  # underscores, as vLLM's
    assert "1 requests, 2 tokens" in capsys.readouterr().out
