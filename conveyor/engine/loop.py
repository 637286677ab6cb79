"""EngineLoop: one LLMEngine stepped on its own thread, fed through a command queue.

The engine is not thread-safe, so exactly one thread (the loop thread) touches it. Other threads
`send` commands into a thread-safe queue that the loop thread drains between steps; when there is
nothing to run it sleeps on an event and never polls. What a command means, where outputs go and
how a host hears of them is the host's: the local server's AsyncEngine (async_engine.py) and the
Ray worker's EngineWorker (conveyor/distributed/worker.py) are the two hosts of this one loop.

An engine is best built on the thread that will step it (`build_on_own_thread`): libgomp keeps a
team of worker threads per thread that starts parallel regions, and with two teams (loading on
the main thread, stepping on another) it has more threads than a 2-core machine has cores and
stops spinning at barriers; every parallel region then waits for a sleeping worker (docs/PERF.md,
"Serving").
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import sys
import threading
from typing import Any, Callable, Generic, TypeVar

from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput

log = logging.getLogger("conveyor.engine")

GIL_SWITCH_INTERVAL_S = 0.0002
STALL_WAIT_S = 0.005  # a step that scheduled nothing: wait this long (or for a command) before the next


def shorten_gil_switch_interval() -> None:
    """For a process that steps an engine on one thread beside an asyncio loop on another.

    The engine thread drops the GIL in every kernel call (and numpy's larger ops) and must take it
    back to issue the next; when the event loop holds it (streaming 32 responses), CPython's default
    5 ms switch interval stalls the step with both cores idle (docs/PERF.md, "Serving")."""
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))


Built = TypeVar("Built")


def build_on_own_thread(build: Callable[[], Built], name: str,
                        then: Callable[[Built], None]) -> tuple[Built, threading.Thread]:
    """Runs `build` on a new daemon thread and returns what it built with the thread (raising what
    building raised); the thread goes on to `then(built)`, typically to wait for a go and step."""
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


def call_on_loop(loop: asyncio.AbstractEventLoop | None, fn: Callable[..., Any], *args: Any) -> None:
    """Hand `fn(*args)` to the event loop from the loop thread; nothing if it is closed (nobody listens)."""
    if loop is None:
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed
        pass


Command = TypeVar("Command")


class EngineLoop(Generic[Command]):
    """The loop; a host overrides the hooks below (`_handle` at least)."""

    engine: LLMEngine

    def __init__(self, thread_name: str) -> None:
        self.thread_name = thread_name
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._go = threading.Event()  # a loop thread that built the engine waits here for start_loop()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # --- any thread -------------------------------------------------------------------------------
    def send(self, command: Command) -> None:
        self._commands.put(command)
        self._wake.set()

    def start_loop(self) -> None:
        if self._thread is not None:  # built on its thread (build_engine): that thread waits for the go
            self._go.set()
            return
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop_loop(self, timeout: float | None = None) -> None:
        """Ask the loop to end after its iteration; with a timeout, wait that long for its thread."""
        self._stopping = True
        self._wake.set()
        self._go.set()
        if timeout is not None and self._thread is not None:
            self._thread.join(timeout)

    @property
    def loop_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def _park_on(self, thread: threading.Thread) -> None:
        """`thread` built this loop's engine and waits in `_wait_then_run` for `start_loop`."""
        self._thread = thread

    def _wait_then_run(self) -> None:
        self._go.wait()
        if not self._stopping:
            self._run()

    def _take_queued(self) -> list[Command]:
        """Every command not handled yet (the loop is gone: its host answers them)."""
        taken = []
        while True:
            try:
                taken.append(self._commands.get_nowait())
            except queue.Empty:
                return taken

    # --- the loop thread --------------------------------------------------------------------------
    def _run(self) -> None:
        error: BaseException | None = None
        try:
            self._loop_forever()
        except BaseException as exc:  # a bug here must not leave anyone waiting forever
            log.exception("the loop of %s died", self.thread_name)
            error = exc
        finally:
            self._stopping = True  # refuse new work
            self._on_exit(error)

    def _loop_forever(self) -> None:
        stalled = False  # the last step scheduled nothing although requests are unfinished
        while not self._stopping:
            if not self.engine.has_unfinished_requests:
                self._wake.wait(self._idle_timeout())
            elif stalled:  # e.g. a pool full of parked blocks: wait for a command, never spin
                self._wake.wait(STALL_WAIT_S)
            self._wake.clear()
            if self._stopping:
                break
            self._begin_iteration()
            self._drain()
            self._before_step()
            stepped = self.engine.has_unfinished_requests
            if stepped:
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # never leave a request in silence
                    log.exception("engine step failed on %s; failing the requests in flight", self.thread_name)
                    self._fail_all(exc)
                    stalled = True
                else:
                    stalled = self.engine.last_step.num_requests == 0
                    self._on_outputs(outputs)
            self._end_iteration(stepped)

    def _drain(self) -> None:
        while not self._commands.empty():  # this thread is the only consumer
            self._handle(self._commands.get_nowait())

    # --- hooks --------------------------------------------------------------------------------------
    def _idle_timeout(self) -> float | None:
        """How long an idle loop sleeps before looking again without a command (None: until one)."""
        return None

    def _begin_iteration(self) -> None: ...

    def _handle(self, command: Command) -> None:
        raise NotImplementedError

    def _before_step(self) -> None: ...

    def _on_outputs(self, outputs: list[RequestOutput]) -> None: ...

    def _fail_all(self, error: BaseException) -> None:
        """The step raised: abort and answer every request in flight."""

    def _end_iteration(self, stepped: bool) -> None:
        """Publish what the iteration did (after the step, or after commands alone)."""

    def _on_exit(self, error: BaseException | None) -> None:
        """The loop ended: stopped (None) or died (`error`)."""
