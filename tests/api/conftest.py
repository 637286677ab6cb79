"""The real server as a subprocess on a free loopback port, with the default model."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

try:  # the openai client ships httpx2; older ones use httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(*args: str, env: dict[str, str] | None = None, timeout: float = 180.0) -> Server:
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="conveyor-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "conveyor.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server did not become healthy in {timeout} s:\n{server.log()}")


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`, from a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
                found = True
    if not found:
        raise KeyError(f"{name} {labels} not in /metrics")
    return total


@pytest.fixture(scope="session")
def server():
    """One server with the default options for every test module that needs no special flags."""
    srv = start_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def http(server: Server):
    with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="session")
def client(server: Server):
    import openai

    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120.0)


TINY_MAX_REQUEST_BYTES = 256 * 1024


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """A server on a tiny random model (fast steps) for the fuzz and chaos tests. A short context
    bounds the work a generated request can ask for (the chat default is the room left)."""
    from tests.helpers import make_tiny_hf_checkpoint

    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-server"))
    srv = start_server(str(folder), "--max-model-len", "64", "--max-num-seqs", "8", "--max-waiting-requests", "64",
                       "--max-request-bytes", str(TINY_MAX_REQUEST_BYTES), "--num-threads", "1")
    yield srv
    srv.stop()


def in_process_app(model: str, **engine: int) -> Iterator[tuple[Any, Any]]:
    """(TestClient, ServerState) of the app over a real engine on `model`, in this process (a
    module fixture's body); skips when the model cannot be loaded."""
    from fastapi.testclient import TestClient

    from conveyor.api.app import ServerState, build_app
    from conveyor.api.metrics import Metrics
    from conveyor.config import EngineConfig
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.errors import ModelLoadError
    from conveyor.runner.model_runner import load_model

    config = EngineConfig.from_kwargs(model=model, **engine)
    try:
        loaded = load_model(config)
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    state = ServerState(AsyncEngine(LLMEngine.from_config(config, loaded)), [model], Metrics(model),
                        max_num_seqs=config.scheduler.max_num_seqs)  # as the server states it
    with TestClient(build_app(state)) as http:
        yield http, state
