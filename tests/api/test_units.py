"""Fast unit tests, no model: incremental detokenisation and the AsyncEngine loop thread."""
from __future__ import annotations

import asyncio

import pytest

from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.config import EngineConfig
from conveyor.engine.async_engine import Aborted, AsyncEngine
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.errors import InvalidRequestError, QueueFullError
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler import SchedulerOutput
from tests.fakes import FakeRunner


class ByteTokenizer:
    """One token per UTF-8 byte: the harshest case for characters that span tokens."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def stream(text: str, stop=(), include_stop: bool = False) -> list[str]:
    """One piece per token, as a stream sends them, until a stop string or the end."""
    detok = IncrementalDetokenizer(ByteTokenizer(), stop, include_stop)
    ids = list(text.encode())
    pieces = []
    for i, token in enumerate(ids):
        detok.add([token])
        if detok.stopped or i == len(ids) - 1:
            pieces.append(detok.finish())
            break
        pieces.append(detok.release())
    return pieces


def test_multibyte_characters_are_never_split():
    text = "café ☕ 日本語 🚂!"
    pieces = stream(text)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_text_at_or_past_a_stop_string_is_never_streamed():
    text = "Hello world. STOP here"
    pieces = stream(text, stop=["STOP"])
    assert "".join(pieces) == "Hello world. "
    assert len(pieces) == len("Hello world. STOP")  # it ended on the token that completed the string
    released = ""
    for piece in pieces:
        released += piece
        assert "S" not in released  # not even the start of the stop string leaked early
    assert "".join(stream(text, stop=["STOP"], include_stop=True)) == "Hello world. STOP"


def test_stop_strings_are_found_across_tokens_and_characters_once():
    calls = []

    class Counting(ByteTokenizer):
        def decode(self, ids, skip_special_tokens: bool = True) -> str:
            calls.append(len(ids))
            return super().decode(ids)

    detok = IncrementalDetokenizer(Counting(), ["☕ ok", "zz"])
    text = "é" * 300 + " ☕ ok and more"
    for token in text.encode():
        detok.add([token])
        if detok.stopped:
            break
    assert detok.stopped and detok.stop_reason == "☕ ok" and detok.finish() == "é" * 300 + " "
    assert max(calls) <= 8  # a short window per token, never the whole output
    assert detok.num_tokens_at_stop == len(("é" * 300 + " ☕ ok").encode())


def test_finish_flushes_an_incomplete_character_as_a_whole_decode_does():
    detok = IncrementalDetokenizer(ByteTokenizer())
    ids = list("ab☕".encode())[:-1]
    for token in ids:
        detok.add([token])
    assert detok.release() == "ab"
    assert detok.finish() == bytes(ids).decode("utf-8", errors="replace")[2:]


def test_partial_stop_prefix_is_released_once_it_cannot_match():
    pieces = stream("a ST b", stop=["STOP"])
    assert pieces == ["a", " ", "", "", "ST ", "b"]  # "S", "T" held back, then released


class Collector:
    def __init__(self, engine: AsyncEngine) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.engine = engine

    async def add(self, rid: str, prompt: list[int], **params) -> None:
        await self.engine.add_request(rid, prompt, SamplingParams(temperature=0.0, **params), self.queue)

    async def until_finished(self) -> list:
        events = []
        while True:
            event = await asyncio.wait_for(self.queue.get(), 10)
            events.append(event)
            if not isinstance(event, RequestOutput) or event.finished:
                return events


def make_async_engine(**kwargs) -> AsyncEngine:
    config = EngineConfig.from_kwargs(max_num_seqs=2)
    engine = LLMEngine(config, FakeRunner(), num_kv_blocks=64, max_model_len=128, vocab_size=1000)
    return AsyncEngine(engine, **kwargs)


def test_async_engine_runs_aborts_and_bounds_its_queue():
    reports = []

    async def main() -> None:
        engine = make_async_engine(max_waiting_requests=1, on_report=reports.append)
        engine.start()
        try:
            sink = Collector(engine)
            await sink.add("a", [1, 2, 3], max_tokens=5)
            events = await sink.until_finished()
            assert [len(e.new_token_ids) for e in events] == [1] * 5 and events[-1].finish_reason == "length"
            assert events[0].token_ids == events[-1].token_ids[:1]  # outputs are snapshots

            with pytest.raises(InvalidRequestError):
                await sink.add("bad", [1, 2], max_tokens=1000)  # cannot fit max_model_len

            # Idle: the loop thread sleeps on its event, no step runs.
            before = len(reports)
            await asyncio.sleep(0.3)
            assert len(reports) == before

            engine.engine.scheduler.schedule = SchedulerOutput  # from here on nobody gets scheduled
            await sink.add("parked", [4, 5], max_tokens=100)
            engine.abort("parked")
            events = await sink.until_finished()
            assert [type(e) for e in events] == [Aborted]

            # Four requests arrive at once: two take the free running seats, one fills the waiting
            # queue, the next is refused.
            results = await asyncio.gather(*(sink.add(f"w{i}", [1], max_tokens=3) for i in range(4)),
                                           return_exceptions=True)
            assert [isinstance(r, QueueFullError) for r in results] == [False, False, False, True]
        finally:
            engine.stop()

    asyncio.run(main())
    assert reports[-1].num_running == 0 and reports[-1].kv_usage == 0.0
    assert any(r.num_aborted for r in reports)


def test_async_engine_shortens_the_gil_switch_interval(monkeypatch: pytest.MonkeyPatch):
    """The loop thread retakes the GIL after every torch op; the default 5 ms handoff stalls steps."""
    import sys

    from conveyor.engine.loop import GIL_SWITCH_INTERVAL_S

    calls: list[float] = []
    monkeypatch.setattr(sys, "setswitchinterval", calls.append)

    async def main() -> None:
        engine = make_async_engine()
        engine.start()
        engine.stop()

    asyncio.run(main())
    assert calls and calls[-1] <= GIL_SWITCH_INTERVAL_S


def test_build_makes_the_engine_on_the_thread_that_steps_it():
    import threading

    seen: dict[str, str] = {}

    def make() -> LLMEngine:
        seen["built on"] = threading.current_thread().name
        config = EngineConfig.from_kwargs(max_num_seqs=2)
        return LLMEngine(config, FakeRunner(), num_kv_blocks=64, max_model_len=128, vocab_size=1000)

    async def main() -> None:
        engine = AsyncEngine.build(make)
        assert not engine.is_running  # built, waiting for start()
        engine.start()
        try:
            sink = Collector(engine)
            await sink.add("a", [1, 2, 3], max_tokens=3)
            events = await sink.until_finished()
            assert events[-1].finish_reason == "length"
            assert seen["built on"] == engine._thread.name == "conveyor-engine-loop"
        finally:
            engine.stop()
        assert not engine._thread.is_alive()

    asyncio.run(main())


def test_build_raises_the_factorys_error_and_a_never_started_engine_stops():
    def broken() -> LLMEngine:
        raise InvalidRequestError("no such model")

    with pytest.raises(InvalidRequestError, match="no such model"):
        AsyncEngine.build(broken)
    config = EngineConfig.from_kwargs(max_num_seqs=2)
    engine = AsyncEngine.build(lambda: LLMEngine(config, FakeRunner(), num_kv_blocks=8, max_model_len=32, vocab_size=100))
    engine.stop(timeout=5)
    assert not engine._thread.is_alive()


def test_stop_strings_are_not_looked_for_before_min_tokens():
    detok = IncrementalDetokenizer(ByteTokenizer(), [","], min_tokens=6)
    for token in b"1, 2, 3, 4,":
        detok.add([token])
        if detok.stopped:
            break
    # Tokens 2 and 5 are commas, inside the first six; the next one, token 8, ends it (as vLLM).
    assert detok.stopped and detok.num_tokens_at_stop == 8 and detok.finish() == "1, 2, 3"
