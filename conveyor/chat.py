"""`conveyor chat`: a conversation in the terminal with a running server, as `vllm chat` holds one.

Each line read is a user turn; the answer streams back as it is generated and joins the history
the next turn is sent with. End with Ctrl-D; Ctrl-C stops an answer (the turn is left out) and, at
the prompt, ends the chat. It is a client of the OpenAI API only, so it talks to any server of it
(conveyor's, vLLM's, llama.cpp's).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, Iterator, TextIO

import httpx

from conveyor.config import client_api_key
from conveyor.errors import ConfigError

DEFAULT_URL = "http://127.0.0.1:8000/v1"
# An answer is kept in the history only if it ended as a model ends one (not aborted, not failed).
_COMPLETE = ("stop", "length", "tool_calls")


@dataclass
class ChatConfig:
    url: str = DEFAULT_URL  # the API's base, ending in /v1
    model: str | None = None  # None: the first model the server lists
    system_prompt: str | None = None
    api_key: str | None = None  # None: config.client_api_key()
    quick: str | None = None  # one message: its answer is printed and the command ends


class _BrokenAnswer(Exception):
    """A streamed answer that did not end as a complete one."""


class ChatSession:
    def __init__(self, config: ChatConfig) -> None:
        key = config.api_key or client_api_key()
        try:
            self.http = httpx.Client(base_url=config.url.rstrip("/"), timeout=httpx.Timeout(600.0, connect=10.0),
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
        except httpx.InvalidURL as exc:
            raise ConfigError(f"--url {config.url!r} is not a URL: {exc}") from None
        self.url = config.url
        self.model = config.model or self._first_model()
        self.messages: list[dict[str, str]] = []
        if config.system_prompt:
            self.messages.append({"role": "system", "content": config.system_prompt})

    def _first_model(self) -> str:
        try:
            reply = self.http.get("/models")
        except httpx.TransportError as exc:
            raise ConfigError(f"cannot reach the server at {self.url} (--url): {exc}") from None
        if reply.status_code != 200:
            raise ConfigError(f"{self.url}/models answered {reply.status_code}: {_error_text(reply.text)}")
        try:
            return str(reply.json()["data"][0]["id"])
        except (ValueError, LookupError, TypeError) as exc:
            raise ConfigError(f"{self.url}/models lists no model (--model-name names one): {exc!r}") from None

    def turn(self, text: str, out: TextIO) -> bool:
        """Sends one user turn and writes the answer as it streams. False (and the turn left out of
        the history) when the server refused it or the answer broke off; the reason goes to stderr."""
        messages = [*self.messages, {"role": "user", "content": text}]
        body = {"model": self.model, "messages": messages, "stream": True}
        answer: list[str] = []
        try:
            with self.http.stream("POST", "/chat/completions", json=body) as reply:
                if reply.status_code != 200:
                    print(f"conveyor chat: the server refused the turn ({reply.status_code}): "
                          f"{_error_text(reply.read().decode(errors='replace'))}", file=sys.stderr)
                    return False
                for delta in _answer(reply.iter_lines()):
                    answer.append(delta)
                    out.write(delta)
                    out.flush()
        except (httpx.TransportError, _BrokenAnswer) as exc:
            out.write("\n")
            print(f"conveyor chat: the answer broke off: {exc}", file=sys.stderr)
            return False
        out.write("\n")
        self.messages = [*messages, {"role": "assistant", "content": "".join(answer)}]
        return True


def _answer(lines: Iterator[str]) -> Iterator[str]:
    """The content deltas of a streamed chat answer (server-sent events); raises _BrokenAnswer where
    it does not end complete: an error event, a finish other than a model's, no [DONE]."""
    finish = None
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            if finish not in _COMPLETE:
                raise _BrokenAnswer(f"finish_reason {finish!r}")
            return
        try:
            event: Any = json.loads(data)
            if event.get("error"):
                raise _BrokenAnswer(_error_text(data))
            for choice in event.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                if text := (choice.get("delta") or {}).get("content"):
                    yield text
        except (ValueError, AttributeError, TypeError) as exc:
            raise _BrokenAnswer(f"not a chat event: {data[:200]!r} ({exc})") from None
    raise _BrokenAnswer("the stream ended without [DONE]")


def _error_text(body: str) -> str:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    if error is None:
        return body.strip()[:500]
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def run_chat(config: ChatConfig, lines: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    """0, or 1 if any turn was refused or broke off (for scripts that pipe turns in)."""
    session = ChatSession(config)
    if config.quick is not None:
        return 0 if session.turn(config.quick, out) else 1
    interactive, failed = lines.isatty(), False
    if interactive:
        import readline  # noqa: F401 - line editing and history for input()

        print(f"chatting with {session.model} at {config.url}; Ctrl-D ends", file=sys.stderr)
    while True:
        if interactive:
            try:
                text = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return int(failed)
        else:
            line = lines.readline()
            if not line:
                return int(failed)
            text = line.rstrip("\r\n")
        if not text.strip():
            continue
        try:
            failed |= not session.turn(text, out)
        except KeyboardInterrupt:
            if not interactive:
                raise
            print("\n(answer stopped; the turn is left out)", file=sys.stderr)
