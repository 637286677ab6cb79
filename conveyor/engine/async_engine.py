"""AsyncEngine: the LLMEngine step loop (engine/loop.py) on its own thread, fed and read from asyncio.

Callers on the event loop send commands (add, abort) through the loop's queue; after every
iteration the loop thread hands the step's outputs back with a single `call_soon_threadsafe`,
which puts each output into the asyncio queue of the request it belongs to. Tokenisation and
detokenisation happen on the caller's side: the loop thread only ever sees token ids.

`AsyncEngine.build` also builds the engine on the loop thread, so one thread does all of the
process's model work (engine/loop.py: libgomp's teams; docs/PERF.md, "Serving").
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.loop import EngineLoop, build_on_own_thread, call_on_loop, shorten_gil_switch_interval
from conveyor.engine.outputs import RequestOutput
from conveyor.errors import EngineStoppedError, QueueFullError
from conveyor.model.facts import ModelFacts
from conveyor.runner.stats import StepStats
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.pooling import PoolingParams

log = logging.getLogger("conveyor.engine")


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
class _StopSample:
    request_id: str
    index: int
    stop_reason: str | None


@dataclass
class _Sink:
    queue: asyncio.Queue
    remaining: int  # samples not finished yet (n of them)


class AsyncEngine(EngineLoop[_Add | _Abort | _StopSample]):
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 on_report: Callable[[StepReport], None] | None = None) -> None:
        super().__init__("conveyor-engine-loop")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.on_report = on_report
        self._lock = threading.Lock()  # guards the three admission counters below
        self._queued_adds = 0  # add commands the loop thread has not taken yet
        self._num_waiting = 0  # the scheduler's waiting queue after the last iteration
        # Running seats free after the last iteration: that many of the waiting and queued
        # requests will take a slot at the next step rather than wait for one.
        self._free_seats = engine.scheduler.max_num_seqs
        self._sinks: dict[str, _Sink] = {}  # loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        # What the current iteration did, published at its end (loop thread only).
        self._report = StepReport(0, 0, 0.0, 0, None)
        self._resolved: list[tuple[asyncio.Future, BaseException | None]] = []
        self._events: list[tuple[asyncio.Queue, object]] = []
        self._taken = 0

    @classmethod
    def build(cls, make_engine: Callable[[], LLMEngine], max_waiting_requests: int | None = None,
              on_report: Callable[[StepReport], None] | None = None) -> "AsyncEngine":
        """Builds the engine on a new loop thread (blocking until it is built; the factory's
        exception is raised here) and keeps that thread to step it once `start` is called."""
        engine, thread = build_on_own_thread(lambda: cls(make_engine(), max_waiting_requests, on_report),
                                             "conveyor-engine-loop", lambda built: built._wait_then_run())
        engine._park_on(thread)
        return engine

    # --- lifecycle (event loop side) ------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        shorten_gil_switch_interval()
        self.start_loop()

    def stop(self, timeout: float = 10.0) -> None:
        self.stop_loop(timeout)

    @property
    def is_running(self) -> bool:
        return self._loop is not None and self.loop_alive

    # --- what the front end reads (conveyor.engine.client.EngineClient) ----------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def default_pooling(self) -> PoolingParams:
        return self.engine.default_pooling

    @property
    def embedding_size(self) -> int | None:
        return self.engine.embedding_size

    @property
    def model_facts(self) -> ModelFacts | None:
        return self.engine.model_facts

    @property
    def capacity(self) -> int:
        return self.engine.capacity

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
        self.send(_Add(request_id, prompt, params, arrival_time, sink, done))
        try:
            await done
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still land: the abort is queued behind it
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request (all its samples); thread-safe, idempotent."""
        self.send(_Abort(request_id))

    def abort_all(self) -> None:
        self.send(_Abort(None))

    def stop_sample(self, request_id: str, index: int, stop_reason: str | None = None) -> None:
        """End one sample whose text reached a stop string, freeing its KV; thread-safe, idempotent."""
        self.send(_StopSample(request_id, index, stop_reason))

    # --- the loop thread (EngineLoop's hooks) ---------------------------------------------------
    def _begin_iteration(self) -> None:
        self._report, self._resolved, self._events, self._taken = StepReport(0, 0, 0.0, 0, None), [], [], 0

    def _handle(self, cmd: _Add | _Abort | _StopSample) -> None:
        report = self._report
        if isinstance(cmd, _StopSample):
            stopped = self.engine.stop_sample(cmd.request_id, cmd.index, cmd.stop_reason)
            if stopped is not None:
                report.outputs.append(stopped)
                self._route(stopped)
        elif isinstance(cmd, _Add):
            self._taken += 1
            try:
                self.engine.add_request(cmd.prompt, cmd.params, cmd.request_id, cmd.arrival_time)
            except Exception as exc:  # InvalidRequestError: the engine state is unchanged
                self._resolved.append((cmd.done, exc))
                return
            self._sinks[cmd.request_id] = _Sink(cmd.sink, getattr(cmd.params, "n", 1))
            report.num_prompt_tokens += len(cmd.prompt) if isinstance(cmd.prompt, list) else 0
            self._resolved.append((cmd.done, None))
        else:
            ids = list(self._sinks) if cmd.request_id is None else [cmd.request_id]
            for request_id in ids:
                report.num_aborted += self.engine.abort_request(request_id)
                sink = self._sinks.pop(request_id, None)
                if sink is not None:
                    self._events.append((sink.queue, Aborted(request_id)))

    def _before_step(self) -> None:
        with self._lock:  # in one go, so admission never sees a request in neither count
            self._queued_adds -= self._taken
            self._count_waiting()

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self._report.outputs += outputs  # after any stopped samples' final outputs (_handle)
        self._report.stats = self.engine.last_step
        for out in outputs:
            self._route(out)

    def _route(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return
        if out.error is not None:  # the engine failed this request alone (failure isolation)
            self._events.append((sink.queue, Failed(out.request_id, out.error)))
            del self._sinks[out.request_id]
            return
        # The engine keeps appending to token_ids: hand the other thread a copy.
        self._events.append((sink.queue, dataclasses.replace(out, token_ids=list(out.token_ids))))
        if out.finished:
            sink.remaining -= 1
            if sink.remaining <= 0:
                del self._sinks[out.request_id]

    def _fail_all(self, error: BaseException) -> None:
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine is already in trouble; the client still gets its error
                log.exception("abort of %s failed", request_id)
            self._events.append((sink.queue, Failed(request_id, error)))
        self._sinks.clear()

    def _count_waiting(self) -> None:
        """Under the lock: the admission counters from the scheduler's state now."""
        scheduler = self.engine.scheduler
        self._num_waiting = scheduler.num_waiting
        self._free_seats = max(0, scheduler.max_num_seqs - scheduler.num_running)

    def _end_iteration(self, stepped: bool) -> None:
        report, scheduler = self._report, self.engine.scheduler
        report.num_running, report.num_waiting = scheduler.num_running, scheduler.num_waiting
        report.num_preemptions, report.kv_usage = scheduler.num_preemptions, scheduler.kv.usage().usage
        with self._lock:
            self._count_waiting()
        call_on_loop(self._loop, self._deliver, report, self._resolved, self._events)

    def _on_exit(self, error: BaseException | None) -> None:
        """Whatever is still in flight or queued gets an error, never silence."""
        self._begin_iteration()
        stopped = EngineStoppedError("the server is shutting down")
        self._fail_all(stopped)
        for cmd in self._take_queued():
            if isinstance(cmd, _Add):
                self._resolved.append((cmd.done, stopped))
        self._end_iteration(False)

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
