"""AsyncEngine: the LLMEngine step loop on its own thread, fed and read from asyncio.

The engine is not thread-safe, so exactly one thread (the loop thread) touches it. Callers on the
event loop send commands (add, abort) through a thread-safe queue that the loop thread drains
between steps; after every iteration the loop thread hands the step's outputs back with a single
`call_soon_threadsafe`, which puts each output into the asyncio queue of the request it belongs to.
When there is nothing to run the loop thread sleeps on an event; it never polls. Tokenisation and
detokenisation happen on the caller's side: the loop thread only ever sees token ids.

`AsyncEngine.build` also builds the engine on the loop thread, so one thread does all of the
process's torch work: libgomp keeps a team of worker threads per thread that starts parallel
regions, and with two teams (loading on the main thread, stepping on another) it has more threads
than this 2-core machine has cores and stops spinning at barriers; every parallel region then
waits for a sleeping worker. Steps ran ~25% slower that way (docs/PERF.md, "Serving").
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput, StepStats
from conveyor.errors import ConveyorError
from conveyor.sampling.params import SamplingParams

log = logging.getLogger("conveyor.engine")


GIL_SWITCH_INTERVAL_S = 0.0002


def shorten_gil_switch_interval() -> None:
    """For a process that steps an engine on one thread beside an asyncio loop on another.

    The engine thread drops the GIL in every torch op and must take it back to issue the next;
    when the event loop holds it (streaming 32 responses), CPython's default 5 ms switch interval
    stalls the step with both cores idle (docs/PERF.md, "Serving": a 32-request chat benchmark
    served at 86 output tok/s with the default, 93-106 with 0.2 ms; offline 114)."""
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))


Built = TypeVar("Built")


def build_on_own_thread(build: Callable[[], Built], name: str,
                        then: Callable[[Built], None]) -> tuple[Built, threading.Thread]:
    """Runs `build` on a new daemon thread and returns what it built with the thread (raising what
    building raised); the thread goes on to `then(built)`, typically to wait for a go and step.

    So that one thread does all of an engine's torch work: libgomp keeps a team of worker threads
    per thread that starts parallel regions, and two teams on a 2-core machine make every parallel
    region wait for a sleeping worker (docs/PERF.md, "Serving")."""
    built: concurrent.futures.Future[Built] = concurrent.futures.Future()

    def thread_main() -> None:
        try:
            result = build()
        except BaseException as exc:  # raised again on the caller's thread
            built.set_exception(exc)
            return
        built.set_result(result)
        then(result)

    thread = threading.Thread(target=thread_main, name=name, daemon=True)
    thread.start()
    return built.result(), thread


class QueueFullError(ConveyorError):
    """The waiting queue is at its bound: the caller should retry later (HTTP 503)."""


class EngineStoppedError(ConveyorError):
    """The engine loop is stopped or stopping; no request is accepted."""


# The last event of a request that did not finish normally: no further output will come.
@dataclass(frozen=True)
class Aborted:
    request_id: str


@dataclass(frozen=True)
class Failed:
    request_id: str
    error: BaseException


@dataclass
class StepReport:
    """What one loop iteration did, for metrics; built on the loop thread, read on the event loop."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int  # cumulative since start
    stats: StepStats | None  # None when no step ran (only commands were handled)
    outputs: list[RequestOutput] = field(default_factory=list)
    num_aborted: int = 0
    num_prompt_tokens: int = 0  # of the requests accepted in this iteration
    cluster: Any = None  # conveyor.distributed.stats.ClusterStats when the engine is a Ray deployment


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float | None
    sink: asyncio.Queue
    done: asyncio.Future


@dataclass
class _Abort:
    request_id: str | None  # None: every request


@dataclass
class _Sink:
    queue: asyncio.Queue
    remaining: int  # samples not finished yet (n of them)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 on_report: Callable[[StepReport], None] | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.on_report = on_report
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards the three admission counters below
        self._queued_adds = 0  # add commands the loop thread has not taken yet
        self._num_waiting = 0  # the scheduler's waiting queue after the last iteration
        # Running seats free after the last iteration: that many of the waiting and queued
        # requests will take a slot at the next step rather than wait for one.
        self._free_seats = engine.scheduler.max_num_seqs
        self._sinks: dict[str, _Sink] = {}  # loop thread only
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._go = threading.Event()  # build(): the loop thread waits here for start()

    @classmethod
    def build(cls, make_engine: Callable[[], LLMEngine], max_waiting_requests: int | None = None,
              on_report: Callable[[StepReport], None] | None = None) -> "AsyncEngine":
        """Builds the engine on a new loop thread (blocking until it is built; the factory's
        exception is raised here) and keeps that thread to step it once `start` is called."""
        def wait_then_run(engine: AsyncEngine) -> None:
            engine._go.wait()
            if not engine._stopping:
                engine._run()

        engine, thread = build_on_own_thread(lambda: cls(make_engine(), max_waiting_requests, on_report),
                                             "conveyor-engine-loop", wait_then_run)
        engine._thread = thread
        return engine

    # --- lifecycle (event loop side) ------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        shorten_gil_switch_interval()
        if self._thread is not None:  # built by build(): its thread is waiting for the go
            self._go.set()
            return
        self._thread = threading.Thread(target=self._run, name="conveyor-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._go.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return (self._loop is not None and self._thread is not None and self._thread.is_alive()
                and not self._stopping)

    # --- what the front end reads (conveyor.engine.client.EngineClient) ----------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def capacity(self) -> int:
        return min(self.engine.max_model_len, self.engine.kv.num_blocks * self.engine.kv.block_size)

    # --- requests (event loop side) -------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                          sink: asyncio.Queue, arrival_time: float | None = None) -> None:
        """Queue a request whose events go to `sink`. Raises QueueFullError, EngineStoppedError, or
        the engine's InvalidRequestError; returns once the engine has accepted it."""
        if not self.is_running:
            raise EngineStoppedError("the engine is not running")
        with self._lock:
            bound = self.max_waiting_requests
            if bound is not None and self._num_waiting + self._queued_adds - self._free_seats >= bound:
                raise QueueFullError(f"the waiting queue is full ({bound} requests); retry later")
            self._queued_adds += 1
        done = asyncio.get_running_loop().create_future()
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        self._commands.put(_Add(request_id, prompt, params, arrival_time, sink, done))
        self._wake.set()
        try:
            await done
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still land: the abort is queued behind it
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request (all its samples); thread-safe, idempotent."""
        self._commands.put(_Abort(request_id))
        self._wake.set()

    def abort_all(self) -> None:
        self._commands.put(_Abort(None))
        self._wake.set()

    # --- the loop thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException:  # a bug here must not leave clients waiting forever
            log.exception("the engine loop died")
        finally:
            self._stopping = True  # refuse new requests; /health turns 503
            self._shutdown()

    def _loop_forever(self) -> None:
        stalled = False  # the last step scheduled nothing although requests are unfinished
        while not self._stopping:
            if not self.engine.has_unfinished_requests:
                self._wake.wait()
            elif stalled:  # should not happen with the shipped policies; never spin on it
                self._wake.wait(0.005)
            self._wake.clear()
            if self._stopping:
                break
            report = StepReport(0, 0, 0.0, 0, None)
            resolved: list[tuple[asyncio.Future, BaseException | None]] = []
            events: list[tuple[asyncio.Queue, object]] = []
            self._drain(report, resolved, events)
            if self.engine.has_unfinished_requests:
                try:
                    report.outputs = self.engine.step()
                    report.stats = self.engine.last_step
                    stalled = report.stats.num_requests == 0
                except Exception as exc:  # never leave a request in silence
                    log.exception("engine step failed; failing the requests in flight")
                    self._fail_all(exc, events)
                    stalled = True
                self._route(report.outputs, events)
            self._publish(report, resolved, events)

    def _drain(self, report: StepReport, resolved: list, events: list) -> None:
        taken = 0
        while not self._commands.empty():  # this thread is the only consumer
            cmd = self._commands.get_nowait()
            if isinstance(cmd, _Add):
                taken += 1
                try:
                    self.engine.add_request(cmd.prompt, cmd.params, cmd.request_id, cmd.arrival_time)
                except Exception as exc:  # InvalidRequestError: the engine state is unchanged
                    resolved.append((cmd.done, exc))
                    continue
                self._sinks[cmd.request_id] = _Sink(cmd.sink, getattr(cmd.params, "n", 1))
                report.num_prompt_tokens += len(cmd.prompt) if isinstance(cmd.prompt, list) else 0
                resolved.append((cmd.done, None))
            else:
                ids = list(self._sinks) if cmd.request_id is None else [cmd.request_id]
                for request_id in ids:
                    report.num_aborted += self.engine.abort_request(request_id)
                    sink = self._sinks.pop(request_id, None)
                    if sink is not None:
                        events.append((sink.queue, Aborted(request_id)))
        with self._lock:  # in one go, so admission never sees a request in neither count
            self._queued_adds -= taken
            self._count_waiting()

    def _route(self, outputs: list[RequestOutput], events: list) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.error is not None:  # the engine failed this request alone (failure isolation)
                events.append((sink.queue, Failed(out.request_id, out.error)))
                del self._sinks[out.request_id]
                continue
            # The engine keeps appending to token_ids: hand the other thread a copy.
            events.append((sink.queue, dataclasses.replace(out, token_ids=list(out.token_ids))))
            if out.finished:
                sink.remaining -= 1
                if sink.remaining <= 0:
                    del self._sinks[out.request_id]

    def _fail_all(self, exc: BaseException, events: list) -> None:
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine is already in trouble; the client still gets its error
                log.exception("abort of %s failed", request_id)
            events.append((sink.queue, Failed(request_id, exc)))
        self._sinks.clear()

    def _count_waiting(self) -> None:
        """Under the lock: the admission counters from the scheduler's state now."""
        scheduler = self.engine.scheduler
        self._num_waiting = scheduler.num_waiting
        self._free_seats = max(0, scheduler.max_num_seqs - scheduler.num_running)

    def _publish(self, report: StepReport, resolved: list, events: list) -> None:
        scheduler = self.engine.scheduler
        report.num_running, report.num_waiting = scheduler.num_running, scheduler.num_waiting
        report.num_preemptions, report.kv_usage = scheduler.num_preemptions, self.engine.kv.usage().usage
        with self._lock:
            self._count_waiting()
        try:
            self._loop.call_soon_threadsafe(self._deliver, report, resolved, events)  # type: ignore[union-attr]
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _shutdown(self) -> None:
        """Whatever is still in flight or queued gets an error, never silence."""
        stopped, events = EngineStoppedError("the server is shutting down"), []
        self._fail_all(stopped, events)
        resolved = []
        while not self._commands.empty():
            cmd = self._commands.get_nowait()
            if isinstance(cmd, _Add):
                resolved.append((cmd.done, stopped))
        self._publish(StepReport(0, 0, 0.0, 0, None), resolved, events)

    # --- back on the event loop -----------------------------------------------------------------
    def _deliver(self, report: StepReport, resolved: list, events: list) -> None:
        for done, exc in resolved:
            if not done.done():
                done.set_result(None) if exc is None else done.set_exception(exc)
        for sink, event in events:
            sink.put_nowait(event)
        if self.on_report is not None:
            try:
                self.on_report(report)
            except Exception:
                log.exception("metrics update failed")
