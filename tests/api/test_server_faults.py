"""A real fault (issue 18, cases 6 and 9) on an in-process server with a scripted engine: the 500
carries a generic message (the exception's text only in the log) and the keep-alive connection
stays usable for the next request."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from typing import Any, Sequence

import pytest
import uvicorn

from conveyor.api.app import ServerState, build_app
from conveyor.api.metrics import Metrics
from conveyor.engine.async_engine import Failed
from conveyor.sampling.params import SamplingParams
from tests.api.conftest import free_port

SECRET = "secret internals: /etc/passwd at 0xdeadbeef"


class ScriptedEngine:
    """An EngineClient whose requests fail: prompt [1] raises in add_request, [2] fails in the
    engine (a Failed event), the way a broken step reaches the front end."""

    on_report = None
    tokenizer = None
    max_model_len = capacity = 100
    is_running = True

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None: ...

    def stop(self, timeout: float = 10.0) -> None: ...

    async def add_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                          sink: asyncio.Queue, arrival_time: float | None = None) -> None:
        if list(prompt) == [1]:
            raise RuntimeError(SECRET)
        sink.put_nowait(Failed(request_id, RuntimeError(SECRET)))

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...


@pytest.fixture(scope="module")
def fault_server():
    state = ServerState(ScriptedEngine(), ["m"], Metrics("m"))  # type: ignore[arg-type]
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(10)


def _request(sock: socket.socket, method: str, path: str, body: dict | None = None) -> tuple[int, dict[str, str], Any]:
    """One HTTP/1.1 request on an open connection; returns status, headers, decoded body."""
    payload = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    sock.sendall(head.encode() + payload)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    raw_head, rest = data.split(b"\r\n\r\n", 1)
    lines = raw_head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection mid-body")
        rest += chunk
    return int(lines[0].split()[1]), headers, json.loads(rest[:length]) if length else None


@pytest.mark.parametrize("prompt", [[1], [2]], ids=["raises in the handler", "fails in the engine"])
def test_a_500_is_generic_and_keeps_the_connection(fault_server, prompt, caplog):
    with socket.create_connection(("127.0.0.1", fault_server), timeout=10) as sock:
        with caplog.at_level(logging.ERROR, logger="conveyor.api"):
            status, headers, body = _request(sock, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert status == 500, body
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "server_error" and SECRET not in json.dumps(body)
        assert "RuntimeError" not in body["error"]["message"]
        assert headers.get("connection", "").lower() != "close"
        assert SECRET in caplog.text  # the details went to the log
        # The same connection serves the next request.
        status, _, body = _request(sock, "GET", "/health")
        assert status == 200 and body == {"status": "ok"}


def test_a_stream_that_fails_ends_with_a_generic_error_event(fault_server):
    with socket.create_connection(("127.0.0.1", fault_server), timeout=10) as sock:
        payload = json.dumps({"prompt": [2], "max_tokens": 2, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        data = b""
        while b"data: [DONE]" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    assert b"server_error" in data and SECRET.encode() not in data
