"""What the Responses API (openai_responses.py) and Anthropic's Messages API
(anthropic_messages.py) share, each being served as the chat it amounts to: the chat format's
deltas as plain parts, and the chat pipeline's refusals with the fields named as the request
names them."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from conveyor.api.errors import APIError
from conveyor.api.generation import Generation
from conveyor.api.responses import CompletionFormat


@dataclass
class ChatDelta:
    """What one token changed in the chat format's answer."""

    text: str  # content text released
    logprobs: list[dict[str, Any]]  # the chat's logprob entries of this token (none asked: [])
    calls: list[dict[str, Any]]  # tool-call deltas (index, and id and name when a call starts)
    finish: str | None  # the chat's finish_reason, once it ends


async def chat_deltas(gen: Generation, fmt: CompletionFormat) -> AsyncIterator[ChatDelta]:
    """The one-choice chat answer of `gen`, token by token, as `fmt` (plain or tool calls) makes it."""
    first = True
    async for choice, delta, logprobs in gen.updates():
        entry = fmt.choice_delta(choice, delta, logprobs, first=first)
        first = False
        if entry is None:
            continue
        out = entry["delta"]
        yield ChatDelta(out.get("content") or "", (entry.get("logprobs") or {}).get("content") or [],
                        out.get("tool_calls") or [], entry["finish_reason"])


def renamed(error: APIError, fields: Sequence[tuple[str, str]], message_fields: dict[str, str] | None = None) -> APIError:
    """A refusal the chat pipeline raised, its `param` (and the message that names it) renamed:
    a chat message's path (messages.3, messages.3.tool_calls.0) as `message_fields` maps it to
    what the client sent, else by the first of `fields` (regex, replacement) that matches."""
    param = error.param
    if param is None:
        return error
    new = param
    message = re.match(r"messages\.\d+(\.tool_calls(\.\d+)?)?", param)
    if message is not None and message_fields:
        path = message.group(0)
        while path not in message_fields and "." in path.removeprefix("messages."):
            path = path.rsplit(".", 1)[0]  # the closest enclosing path that names what was sent
        new = message_fields.get(path, new)
    else:
        for pattern, replacement in fields:
            if re.match(pattern, param):
                new = re.sub(pattern, replacement, param, count=1)
                break
    if new != param:
        error.message = error.message.replace(param, new)
        error.param = new
    return error
