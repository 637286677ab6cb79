"""`conveyor chat`: a conversation in the terminal with a running server, as `vllm chat` holds one.

Each line read is a user turn; the answer streams back as it is generated and joins the history
the next turn is sent with. End with Ctrl-D (or Ctrl-C). It is a client of the OpenAI API only, so
it talks to any server of it (conveyor's, vLLM's, llama.cpp's).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator, TextIO

import httpx

from conveyor.errors import ConfigError

DEFAULT_URL = "http://127.0.0.1:8000/v1"


@dataclass
class ChatConfig:
    url: str = DEFAULT_URL  # the API's base, ending in /v1
    model: str | None = None  # None: the first model the server lists
    system_prompt: str | None = None
    api_key: str | None = None  # None: $CONVEYOR_API_KEY, else $OPENAI_API_KEY
    quick: str | None = None  # one message: its answer is printed and the command ends


class _StreamError(Exception):
    """An error event in the middle of a streamed answer."""


class ChatSession:
    def __init__(self, config: ChatConfig) -> None:
        key = config.api_key or os.environ.get("CONVEYOR_API_KEY") or os.environ.get("OPENAI_API_KEY")
        self.http = httpx.Client(base_url=config.url.rstrip("/"), timeout=httpx.Timeout(600.0, connect=10.0),
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
        self.model = config.model or self._first_model(config.url)
        self.messages: list[dict[str, str]] = []
        if config.system_prompt:
            self.messages.append({"role": "system", "content": config.system_prompt})

    def _first_model(self, url: str) -> str:
        try:
            reply = self.http.get("/models")
        except httpx.TransportError as exc:
            raise ConfigError(f"cannot reach the server at {url} (--url): {exc}") from None
        if reply.status_code != 200:
            raise ConfigError(f"{url}/models answered {reply.status_code}: {_error_text(reply.text)}")
        models = reply.json().get("data") or []
        if not models:
            raise ConfigError(f"{url} serves no model")
        return str(models[0]["id"])

    def turn(self, text: str, out: TextIO) -> bool:
        """Sends one user turn and writes the answer as it streams. False (and the turn left out of
        the history) when the server refused it; the error is written to stderr."""
        messages = [*self.messages, {"role": "user", "content": text}]
        body = {"model": self.model, "messages": messages, "stream": True}
        answer: list[str] = []
        try:
            with self.http.stream("POST", "/chat/completions", json=body) as reply:
                if reply.status_code != 200:
                    print(f"conveyor chat: the server refused the turn ({reply.status_code}): "
                          f"{_error_text(reply.read().decode(errors='replace'))}", file=sys.stderr)
                    return False
                for delta in _deltas(reply.iter_lines()):
                    answer.append(delta)
                    out.write(delta)
                    out.flush()
        except (httpx.TransportError, _StreamError) as exc:
            print(f"\nconveyor chat: the answer broke off: {exc}", file=sys.stderr)
            return False
        out.write("\n")
        self.messages = [*messages, {"role": "assistant", "content": "".join(answer)}]
        return True


def _deltas(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event: dict[str, Any] = json.loads(line[6:])
        if "error" in event:  # a failure mid-stream, as the server reports it
            raise _StreamError(_error_text(json.dumps(event)))
        for choice in event.get("choices") or []:
            if text := (choice.get("delta") or {}).get("content"):
                yield text


def _error_text(body: str) -> str:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body.strip()[:500]
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def run_chat(config: ChatConfig, lines: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    session = ChatSession(config)
    if config.quick is not None:
        return 0 if session.turn(config.quick, out) else 1
    interactive = lines.isatty()
    if interactive:
        print(f"chatting with {session.model} at {config.url}; Ctrl-D ends", file=sys.stderr)
    while True:
        if interactive:
            try:
                text = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
        else:
            line = lines.readline()
            if not line:
                return 0
            text = line.rstrip("\r\n")
        if text.strip():
            session.turn(text, out)
