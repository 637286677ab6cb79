"""`conveyor chat` against the real server: each line a turn, answers streamed, the history sent
with the next turn; a refused turn is reported and left out of it; an unreachable server is one line."""
from __future__ import annotations

import io
import json

import pytest

from conveyor.chat import ChatConfig, ChatSession, run_chat
from conveyor.cli import main
from tests.api.conftest import httpx, start_server


@pytest.fixture(scope="module")
def greedy_server(tmp_path_factory):
    # Greedy and short through the model's recommended sampling, which the chat's requests leave to it.
    folder = tmp_path_factory.mktemp("greedy")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 12}))
    srv = start_server("--generation-config", str(folder), "--max-model-len", "256")
    yield srv
    srv.stop()


def answer(server, messages: list[dict[str, str]]) -> str:
    reply = httpx.post(f"{server.v1}/chat/completions", json={"model": "smollm2-135m", "messages": messages},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_each_line_is_a_turn_sent_with_the_history(greedy_server) -> None:
    out = io.StringIO()
    assert run_chat(ChatConfig(url=greedy_server.v1, system_prompt="Be brief."),
                    io.StringIO("My name is Ada.\n\nWhat is my name?\n"), out) == 0
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "My name is Ada."}]
    one = answer(greedy_server, first)
    two = answer(greedy_server, [*first, {"role": "assistant", "content": one},
                                 {"role": "user", "content": "What is my name?"}])
    assert out.getvalue() == f"{one}\n{two}\n"  # the blank line was no turn
    # which shows the history was sent: without it the second answer is another
    assert two != answer(greedy_server, [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "What is my name?"}])


def test_a_refused_turn_is_reported_and_left_out(greedy_server, capsys: pytest.CaptureFixture[str]) -> None:
    session = ChatSession(ChatConfig(url=greedy_server.v1))
    assert session.model == "smollm2-135m"
    assert not session.turn("word " * 400, io.StringIO())  # past the 256-token context: a 400
    assert "the server refused the turn (400)" in capsys.readouterr().err and session.messages == []
    assert session.turn("Hi", io.StringIO()) and [m["role"] for m in session.messages] == ["user", "assistant"]


def test_an_unreachable_server_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chat", "--url", "http://127.0.0.1:1/v1", "-q", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach the server at http://127.0.0.1:1/v1 (--url)" in err[0]


def _session_over(events: list[str], captured: list[dict]) -> ChatSession:
    """A session whose server answers every turn with these server-sent event lines."""
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        captured.append(json.loads(request.content))
        return httpx.Response(200, text="".join(f"{e}\n\n" for e in events))

    session = ChatSession.__new__(ChatSession)
    session.http = httpx.Client(base_url="http://server/v1", transport=httpx.MockTransport(handle))
    session.url, session.model, session.messages = "http://server/v1", "m", []
    return session


def _chunk(content: str | None = None, finish: str | None = None) -> str:
    delta = {} if content is None else {"content": content}
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


@pytest.mark.parametrize("events, reason", [
    ([_chunk("Hel"), _chunk(None, "abort"), "data: [DONE]"], "finish_reason 'abort'"),  # a server shutting down
    ([_chunk("Hel"), 'data: {"error": {"message": "the engine failed", "code": 500}}'], "the engine failed"),
    ([_chunk("Hel")], "without [DONE]"),  # the connection closed mid-answer
    ([_chunk("Hel"), "data: [1]"], "not a chat event"),
])
def test_an_answer_that_does_not_end_complete_is_left_out(events, reason, capsys) -> None:
    captured: list[dict] = []
    session = _session_over(events, captured)
    out = io.StringIO()
    assert not session.turn("Hi", out) and session.messages == []
    assert out.getvalue() == "Hel\n" and reason in capsys.readouterr().err


def test_a_complete_answer_joins_the_history_sent_next() -> None:
    captured: list[dict] = []
    session = _session_over([_chunk("Hel"), "data:" + _chunk("lo", "stop")[5:], "data: [DONE]"], captured)
    assert session.turn("Hi", io.StringIO()) and session.turn("Again", io.StringIO())  # "data:" without a space too
    assert captured[1]["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                       {"role": "user", "content": "Again"}]
