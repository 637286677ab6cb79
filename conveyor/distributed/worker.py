"""EngineWorker: one LLMEngine inside a Ray actor, its step loop on its own thread.

The actor is asynchronous (its methods are coroutines on the actor's event loop) so that a long
poll, an add waiting for validation and a KV import waiting for free blocks never tie up a thread.
Exactly one thread, the loop thread, builds and steps the engine: methods send it commands through a
thread-safe queue and await the answer. Outputs pile up in an outbox that the front end drains
with `poll` (a long poll: it returns as soon as there is something, or after the timeout).

Roles: a replica runs whole requests. A prefill worker runs a request up to its first token, then
parks it (out of the scheduler, KV blocks kept) and reports HandoverReady; the front end has a
decode worker `import_kv` the exported blocks and then tells this worker to `release` them.
A decode worker takes imported requests (and whole ones the front end does not split, n > 1).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from conveyor.config import EngineConfig
from conveyor.distributed.handover import (
    blocks_to_run,
    export_request,
    import_headroom,
    import_request,
    request_blocks,
)
from conveyor.distributed.messages import (
    HandoverReady,
    KVPayload,
    PollResult,
    RequestError,
    TokenEvent,
    WorkerInfo,
    WorkerLoadReport,
    WorkerLoopDied,
)
from conveyor.engine.async_engine import build_on_own_thread, shorten_gil_switch_interval
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.errors import InvalidRequestError
from conveyor.request import Request
from conveyor.sampling.params import SamplingParams

log = logging.getLogger("conveyor.distributed.worker")
STALL_WAIT_S = 0.005  # a step that scheduled nothing: wait this long (or for a command) before the next


@dataclass
class _Command:
    kind: str  # add, abort, import, release, accounting
    args: tuple
    done: concurrent.futures.Future | None


class EngineWorker:
    def __init__(self, name: str, role: str, config: EngineConfig) -> None:
        self.name, self.role = name, role
        self._stopping = False
        self._go = threading.Event()  # the loop thread waits here for start() after building
        # Built on the thread that will step it, as AsyncEngine.build does: one libgomp team.
        self.engine, _ = build_on_own_thread(lambda: LLMEngine.from_config(config), f"conveyor-{name}",
                                             lambda _: self._wait_then_run())
        runner = self.engine.runner
        self.info = WorkerInfo(
            name=name, role=role, max_model_len=self.engine.max_model_len, num_kv_blocks=self.engine.kv.num_blocks,
            block_size=self.engine.kv.block_size, max_num_seqs=config.scheduler.max_num_seqs,
            kv_block_bytes=sum(k[0].numel() * k.element_size() * 2 for k, _ in runner.kv_caches),  # type: ignore[attr-defined]
        )
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._outbox_lock = threading.Lock()
        # Events stay until a later poll acknowledges them: a poll whose answer never reached its
        # caller (e.g. a front end that went away mid-poll) loses nothing for the next one.
        self._events: list[Any] = []
        self._first_seq = 1  # sequence number of self._events[0]
        self._steps: list[tuple[int, int, dict[str, float]]] = []
        self._load = WorkerLoadReport()
        self._prefill_only: set[str] = set()
        self._parked: dict[str, tuple[Request, list[int]]] = {}  # loop thread writes; export reads
        self._pending_imports: deque[tuple[KVPayload, concurrent.futures.Future]] = deque()
        self._news: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._died: str | None = None  # why the loop thread died; then every method raises

    # --- actor methods (the actor's event loop) ----------------------------------------------------
    async def start(self) -> WorkerInfo:
        self._loop = asyncio.get_running_loop()
        self._news = asyncio.Event()
        shorten_gil_switch_interval()  # the same two-thread shape as AsyncEngine
        self._go.set()
        return self.info

    async def ping(self) -> bool:
        self._check_alive()
        return True

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  prefill_only: bool) -> None:
        """Raises the engine's InvalidRequestError when it refuses the request."""
        await self._call("add", request_id, prompt_token_ids, params, prefill_only)

    async def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    async def export_kv(self, request_id: str) -> KVPayload:
        # Off the loop thread so a long step does not delay the handover: the blocks of a parked
        # request are written by nobody until `release`, and reading other blocks is harmless.
        request, _ = self._parked[request_id]
        return await asyncio.to_thread(export_request, self.engine, request)

    async def import_kv(self, payload: KVPayload) -> None:
        """Returns once the request is in this engine (it may wait for free blocks)."""
        await self._call("import", payload)

    async def release(self, request_id: str) -> None:
        await self._call("release", request_id)

    async def accounting(self) -> dict[str, int]:
        """Blocks in use vs blocks owned by requests (tests check that nothing leaks)."""
        return await self._call("accounting")

    async def poll(self, after: int = 0, timeout: float = 1.0) -> PollResult:
        """Events numbered above `after` (the caller has every one up to it), and the load."""
        assert self._news is not None
        self._check_alive()
        with self._outbox_lock:
            acknowledged = max(0, min(after - self._first_seq + 1, len(self._events)))
            del self._events[:acknowledged]
            self._first_seq += acknowledged
            idle = not self._events and not self._steps
        if idle:
            try:
                await asyncio.wait_for(self._news.wait(), timeout)
            except TimeoutError:
                pass
        self._check_alive()  # the loop may have died while we waited (it sets the news then)
        self._news.clear()  # before taking: news published after this wakes the next poll
        with self._outbox_lock:
            events = list(self._events)
            steps, self._steps = self._steps, []
            load = self._load
        load = WorkerLoadReport(load.num_running, load.num_waiting, load.num_parked, load.kv_usage,
                                load.num_preemptions, steps)
        return PollResult(events, load, self._first_seq + len(events) - 1)

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._go.set()

    def _check_alive(self) -> None:
        if self._died is not None:
            raise WorkerLoopDied(f"the loop of worker {self.name} died: {self._died}")

    def _send(self, kind: str, *args: Any) -> None:
        self._check_alive()
        self._commands.put(_Command(kind, args, None))
        self._wake.set()

    async def _call(self, kind: str, *args: Any) -> Any:
        self._check_alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Command(kind, args, done))
        self._wake.set()
        if self._died is not None:  # it died between the check and the put: nobody would answer
            self._fail_commands()
        return await asyncio.wrap_future(done)

    # --- the loop thread --------------------------------------------------------------------------
    def _wait_then_run(self) -> None:
        self._go.wait()
        if not self._stopping:
            self._run()

    def _run(self) -> None:
        stalled = False
        try:
            while not self._stopping:
                if not self.engine.has_unfinished_requests:
                    self._wake.wait(0.05 if self._pending_imports else None)
                elif stalled:  # e.g. a prefill pool full of parked blocks: wait for a release, don't spin
                    self._wake.wait(STALL_WAIT_S)
                self._wake.clear()
                events: list[Any] = []
                self._drain()
                self._take_imports()
                stepped = self.engine.has_unfinished_requests
                if stepped:
                    try:
                        self._collect(self.engine.step(), events)
                    except Exception as exc:  # never leave a request in silence
                        log.exception("engine step failed on %s", self.name)
                        self._fail_all(exc, events)
                stalled = stepped and self.engine.last_step.num_requests == 0
                self._publish(events, stepped)
        except BaseException as exc:
            log.exception("the loop of %s died", self.name)
            # Answer everyone who waits on the loop, and make poll/ping raise: the front end then
            # handles this worker as dead (retry or fail its requests) instead of waiting forever.
            self._died = repr(exc)
            self._fail_commands()
            if self._loop is not None and self._news is not None:
                try:
                    self._loop.call_soon_threadsafe(self._news.set)
                except RuntimeError:  # the actor's loop is closed
                    pass

    def _fail_commands(self) -> None:
        futures = [done for _, done in self._pending_imports]
        self._pending_imports.clear()
        while True:
            try:
                futures.append(self._commands.get_nowait().done)
            except queue.Empty:
                break
        for done in futures:
            if done is not None and not done.done():
                done.set_exception(WorkerLoopDied(f"the loop of worker {self.name} died: {self._died}"))

    def _drain(self) -> None:
        while not self._commands.empty():
            cmd = self._commands.get_nowait()
            try:
                result = getattr(self, f"_do_{cmd.kind}")(*cmd.args)
            except Exception as exc:
                if cmd.done is not None:
                    cmd.done.set_exception(exc)
                continue
            if cmd.done is not None and result is not _LATER:
                cmd.done.set_result(result)
            elif result is _LATER:
                self._pending_imports.append((cmd.args[0], cmd.done))  # type: ignore[arg-type]

    def _do_add(self, request_id: str, prompt: list[int], params: SamplingParams, prefill_only: bool) -> None:
        self.engine.add_request(prompt, params, request_id)
        if prefill_only:
            self._prefill_only.add(request_id)

    def _do_abort(self, request_id: str) -> None:
        self._prefill_only.discard(request_id)
        if request_id in self._parked:
            self._do_release(request_id)
        self.engine.abort_request(request_id)
        for item in [i for i in self._pending_imports if i[0].request_id == request_id]:
            self._pending_imports.remove(item)
            item[1].set_result(None)

    def _do_release(self, request_id: str) -> None:
        if self._parked.pop(request_id, None) is not None:
            self.engine.kv.free(request_id)

    def _do_import(self, payload: KVPayload) -> object:
        return _LATER  # queued: taken in order as blocks allow, by _take_imports

    def _do_accounting(self) -> dict[str, int]:
        kv = self.engine.kv
        owned = sum(len(t) for t in kv.block_tables.values())
        return {"used_blocks": kv.pool.num_used, "owned_blocks": owned, "num_owners": len(kv.block_tables),
                "parked": len(self._parked), "unfinished": len(self.engine.scheduler.requests)}

    def _take_imports(self) -> None:
        # In arrival order; the head waits for blocks rather than being overtaken (no starvation).
        while self._pending_imports:
            payload, done = self._pending_imports[0]
            needed = blocks_to_run(self.engine, payload)
            if needed > self.engine.kv.num_blocks:  # it would wait forever
                self._pending_imports.popleft()
                done.set_exception(InvalidRequestError(f"request {payload.request_id!r} needs {needed} KV blocks; "
                                                       f"this worker has {self.engine.kv.num_blocks}"))
                continue
            if needed > import_headroom(self.engine):
                return
            self._pending_imports.popleft()
            try:
                import_request(self.engine, payload)
            except Exception as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

    def _collect(self, outputs: list[RequestOutput], events: list[Any]) -> None:
        for out in outputs:
            if out.error is not None:  # the engine failed this request alone (failure isolation)
                events.append(RequestError(out.request_id, str(out.error)))
                self._prefill_only.discard(out.request_id)
                continue
            events.append(TokenEvent(out.request_id, out.index, list(out.new_token_ids), out.finished,
                                     out.finish_reason, out.stop_reason, out.text, out.logprobs, out.num_preemptions))
            if out.request_id not in self._prefill_only:
                continue
            self._prefill_only.discard(out.request_id)
            if out.finished:  # the first token ended it (EOS, max_tokens 1): nothing to hand over
                continue
            request = self.engine.detach_request(out.request_id)
            if request is None:
                continue
            blocks = request_blocks(self.engine, request)
            self._parked[out.request_id] = (request, blocks)
            events.append(HandoverReady(out.request_id, len(blocks), len(blocks) * self.info.kv_block_bytes))

    def _fail_all(self, exc: BaseException, events: list[Any]) -> None:
        for request in list(self.engine.scheduler.requests.values()):
            if self.engine.abort_request(request.group_id):
                events.append(RequestError(request.group_id, f"the engine failed: {exc}"))
            self._prefill_only.discard(request.group_id)

    def _publish(self, events: list[Any], stepped: bool) -> None:
        scheduler, stats = self.engine.scheduler, self.engine.last_step
        load = WorkerLoadReport(scheduler.num_running, scheduler.num_waiting, len(self._parked),
                                self.engine.kv.usage().usage, scheduler.num_preemptions)
        with self._outbox_lock:
            self._events.extend(events)
            if stepped and stats.num_requests:
                self._steps.append((stats.num_requests, stats.num_tokens, dict(stats.extra)))
            # A load change alone is news too (e.g. a release freed blocks): /metrics should see it.
            news = bool(self._events or self._steps) or load != self._load
            self._load = load
        if news and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._news.set)  # type: ignore[union-attr]
            except RuntimeError:  # the actor's loop is closed: the actor is going away
                pass


_LATER = object()
