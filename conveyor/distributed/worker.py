"""EngineWorker: one LLMEngine inside a Ray actor, its step loop on its own thread.

The actor is asynchronous (its methods are coroutines on the actor's event loop) so that a long
poll, an add waiting for validation and a KV import waiting for free blocks never tie up a thread.
Exactly one thread, the loop thread (conveyor/engine/loop.py, as the local server's), builds and
steps the engine: methods send it commands through its queue and await the answer. Outputs pile up
in an outbox that the front end drains with `poll` (a long poll: it returns as soon as there is
something, or after the timeout).

Roles: a replica runs whole requests. A prefill worker runs a request up to its first token, then
parks it (out of the scheduler, KV blocks kept) and reports HandoverReady; the front end has a
decode worker `import_kv` the exported blocks and then tells this worker to `release` them.
A decode worker takes imported requests (and whole ones the front end does not split, n > 1).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from typing import Any

from conveyor.config import EngineConfig
from conveyor.distributed.handover import cached_prefix_blocks, export_request, import_request, request_blocks
from conveyor.distributed.messages import (
    HandoverReady,
    KVImported,
    KVPayload,
    PollResult,
    RequestError,
    TokenEvent,
    WorkerInfo,
    WorkerLoadReport,
)
from conveyor.engine.kv_imports import ImportQueue
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.loop import EngineLoop, build_on_own_thread, call_on_loop, shorten_gil_switch_interval
from conveyor.engine.outputs import RequestOutput
from conveyor.errors import ConveyorError, WorkerDiedError
from conveyor.kv import SequenceKey
from conveyor.request import Request, sequence_key
from conveyor.runner.transfer import kv_transfer
from conveyor.sampling.params import SamplingParams

log = logging.getLogger("conveyor.distributed.worker")
IMPORT_RETRY_S = 0.05  # idle with imports waiting for blocks: look again this often


@dataclass
class _Command:
    kind: str  # add, abort, import, release, accounting
    args: tuple
    done: concurrent.futures.Future | None


@dataclass(eq=False)
class _PendingImport:
    payload: KVPayload
    done: concurrent.futures.Future

    @property
    def request_id(self) -> str:
        return self.payload.request_id

    @property
    def num_computed_tokens(self) -> int:
        return self.payload.num_computed_tokens

    @property
    def window_held_from(self) -> int:
        return self.payload.window_held_from

    @property
    def sequence_key(self) -> SequenceKey:
        return sequence_key(self.payload.params, self.token_slice, self.request_id, len(self.payload.prompt_token_ids))

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt = self.payload.prompt_token_ids
        return (prompt + self.payload.output_token_ids)[start:end] if end > len(prompt) else prompt[start:end]


class EngineWorker(EngineLoop[_Command]):
    def __init__(self, name: str, role: str, config: EngineConfig) -> None:
        super().__init__(f"conveyor-{name}")
        self.name, self.role = name, role
        # A config or model this worker refuses is raised by start(): an error in __init__ reaches the
        # front end as Ray's ActorDiedError, with the worker's traceback in its text and not the error.
        self._refused: ConveyorError | None = None
        try:
            # Built on the thread that will step it, as AsyncEngine.build does: one libgomp team.
            self.engine, thread = build_on_own_thread(lambda: LLMEngine.from_config(config).warm_up(),
                                                      self.thread_name, lambda _: self._wait_then_run())
        except ConveyorError as exc:
            self._refused = exc
            return
        self._park_on(thread)
        # Every layer's K and V of a block (block 0 is in every pool: the window pool's NULL_BLOCK).
        transfer = kv_transfer(self.engine.runner)
        one_block = transfer.read_kv_layers([layer for group in transfer.kv_layer_groups() for layer in group], [0])
        kv = self.engine.scheduler.kv
        self.info = WorkerInfo(
            name=name, role=role, max_model_len=self.engine.max_model_len, num_kv_blocks=kv.num_blocks,
            block_size=kv.block_size, max_num_seqs=config.scheduler.max_num_seqs,
            kv_block_bytes=int(one_block.nbytes),
            default_pooling=self.engine.default_pooling, embedding_size=self.engine.embedding_size,
            model_facts=self.engine.model_facts,
        )
        self._outbox_lock = threading.Lock()
        # Events stay until a later poll acknowledges them: a poll whose answer never reached its
        # caller (e.g. a front end that went away mid-poll) loses nothing for the next one.
        self._events: list[Any] = []
        self._first_seq = 1  # sequence number of self._events[0]
        self._steps: list[tuple[int, int, dict[str, float]]] = []
        self._load = WorkerLoadReport()
        self._prefill_only: set[str] = set()
        # Request -> its samples not yet ended here (loop thread only): a step that raises after
        # failure isolation ended some of them has lost their outputs, and _fail_all must still
        # tell the front end about every one of them.
        self._live: dict[str, int] = {}
        self._parked: dict[str, tuple[Request, list[int]]] = {}  # loop thread writes; export reads
        self._imports: ImportQueue[_PendingImport] = ImportQueue()
        self._iteration_events: list[Any] = []  # loop thread only
        self._news: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._died: str | None = None  # why the loop thread died; then every method raises

    # --- actor methods (the actor's event loop) ----------------------------------------------------
    async def start(self) -> WorkerInfo:
        if self._refused is not None:
            raise self._refused
        self._loop = asyncio.get_running_loop()
        self._news = asyncio.Event()
        shorten_gil_switch_interval()  # the same two-thread shape as AsyncEngine
        self.start_loop()
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

    async def export_kv(self, request_id: str, first_block: int = 0) -> KVPayload:
        """The parked request's KV from block `first_block` on (the importer caches those before)."""
        # Off the loop thread so a long step does not delay the handover: the blocks of a parked
        # request are written by nobody until `release`, and reading other blocks is harmless.
        request, _ = self._parked[request_id]
        return await asyncio.to_thread(export_request, self.engine, request, first_block)

    async def cached_prefix_blocks(self, token_ids: list[int], params: SamplingParams) -> int:
        """How many leading full blocks of `token_ids` (a request with `params`) this worker's
        prefix cache holds (an import of them may leave those out). Read here, not on the loop
        thread: an answer now, not after the step in flight; import_kv checks again."""
        self._check_alive()
        return cached_prefix_blocks(self.engine, token_ids, params)

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
        self.stop_loop()

    def _check_alive(self) -> None:
        if self._died is not None:
            raise WorkerDiedError(f"the loop of worker {self.name} died: {self._died}")

    def _send(self, kind: str, *args: Any) -> None:
        self._check_alive()
        self.send(_Command(kind, args, None))

    async def _call(self, kind: str, *args: Any) -> Any:
        self._check_alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.send(_Command(kind, args, done))
        if self._died is not None:  # it died between the check and the put: nobody would answer
            self._fail_commands()
        return await asyncio.wrap_future(done)

    # --- the loop thread (EngineLoop's hooks) ------------------------------------------------------
    def _idle_timeout(self) -> float | None:
        return IMPORT_RETRY_S if self._imports else None

    def _begin_iteration(self) -> None:
        self._iteration_events = []

    def _handle(self, cmd: _Command) -> None:
        if cmd.kind == "import":  # queued: taken in order as blocks allow (_before_step)
            assert cmd.done is not None
            self._imports.push(_PendingImport(cmd.args[0], cmd.done))
            return
        try:
            result = getattr(self, f"_do_{cmd.kind}")(*cmd.args)
        except Exception as exc:
            if cmd.done is not None:
                cmd.done.set_exception(exc)
            return
        if cmd.done is not None:
            cmd.done.set_result(result)

    def _do_add(self, request_id: str, prompt: list[int], params: SamplingParams, prefill_only: bool) -> None:
        self.engine.add_request(prompt, params, request_id)
        self._live[request_id] = params.n
        if prefill_only:
            self._prefill_only.add(request_id)

    def _do_abort(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        self._prefill_only.discard(request_id)
        if request_id in self._parked:
            self._do_release(request_id)
        self.engine.abort_request(request_id)
        for pending in self._imports.remove(request_id):
            pending.done.set_result(None)

    def _do_release(self, request_id: str) -> None:
        if self._parked.pop(request_id, None) is not None:
            self.engine.scheduler.release_handover(request_id)

    def _do_accounting(self) -> dict[str, int]:
        kv = self.engine.scheduler.kv
        owned = sum(len(t) for t in kv.block_tables.values())
        return {"used_blocks": kv.pool.num_used, "owned_blocks": owned, "num_owners": len(kv.block_tables),
                "parked": len(self._parked), "unfinished": len(self.engine.scheduler.requests)}

    def _before_step(self) -> None:
        self._imports.take(self.engine, self._admit_import, lambda pending, error: pending.done.set_exception(error))

    def _admit_import(self, pending: _PendingImport, cached: list[int]) -> None:
        try:
            import_request(self.engine, pending.payload, cached)
        except Exception as exc:
            pending.done.set_exception(exc)
        else:
            payload = pending.payload
            self._live[payload.request_id] = 1
            # In the outbox before any token of the request: the front end counts the handover
            # before it can see the request end.
            self._iteration_events.append(KVImported(payload.request_id, payload.nbytes, payload.cached_nbytes))
            pending.done.set_result(None)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        events = self._iteration_events
        for out in outputs:
            if out.error is not None:  # failure isolation, or its constraints left no token
                events.append(RequestError(out.request_id, out.error))
                self._prefill_only.discard(out.request_id)
                self._live.pop(out.request_id, None)
                continue
            events.append(TokenEvent(out.request_id, out.index, list(out.new_token_ids), out.finished,
                                     out.finish_reason, out.stop_reason, out.text, out.logprobs, out.num_preemptions,
                                     out.num_cached_tokens, out.ended_on_stop_token, out.prompt_logprobs,
                                     out.embedding))
            if out.finished and out.request_id in self._live:
                self._live[out.request_id] -= 1
                if not self._live[out.request_id]:
                    del self._live[out.request_id]
            if out.request_id not in self._prefill_only:
                continue
            self._prefill_only.discard(out.request_id)
            if out.finished:  # the first token ended it (EOS, max_tokens 1): nothing to hand over
                continue
            request = self.engine.detach_request(out.request_id)
            self._live.pop(out.request_id, None)  # parked: the front end hands it over or releases it
            if request is None:
                continue
            self._parked[out.request_id] = (request, request_blocks(self.engine, request))
            events.append(HandoverReady(out.request_id))

    def _fail_all(self, error: BaseException) -> None:
        # Every request not yet ended here, including those the failed step had already taken out
        # of the engine (failure isolation) before raising, whose final outputs it never returned.
        live, self._live = self._live, {}
        for request_id in dict.fromkeys([*live, *(r.group_id for r in self.engine.scheduler.requests.values())]):
            if self.engine.abort_request(request_id) or request_id in live:
                self._iteration_events.append(RequestError(request_id, ConveyorError(f"the engine failed: {error}")))
            self._prefill_only.discard(request_id)

    def _end_iteration(self, stepped: bool) -> None:
        scheduler, stats = self.engine.scheduler, self.engine.last_step
        load = WorkerLoadReport(scheduler.num_running, scheduler.num_waiting, len(self._parked),
                                scheduler.kv.usage().usage, scheduler.num_preemptions)
        with self._outbox_lock:
            self._events.extend(self._iteration_events)
            if stepped and stats.num_requests:
                self._steps.append((stats.num_requests, stats.num_tokens, dict(stats.extra)))
            # A load change alone is news too (e.g. a release freed blocks): /metrics should see it.
            news = bool(self._events or self._steps) or load != self._load
            self._load = load
        if news and self._news is not None:
            call_on_loop(self._loop, self._news.set)

    def _on_exit(self, error: BaseException | None) -> None:
        if error is None:  # stopped
            return
        # Answer everyone who waits on the loop, and make poll/ping raise: the front end then
        # handles this worker as dead (retry or fail its requests) instead of waiting forever.
        self._died = repr(error)
        self._fail_commands()
        if self._news is not None:
            call_on_loop(self._loop, self._news.set)

    def _fail_commands(self) -> None:
        futures: list[concurrent.futures.Future | None] = [pending.done for pending in self._imports.clear()]
        futures += [cmd.done for cmd in self._take_queued()]
        for done in futures:
            if done is not None and not done.done():
                done.set_exception(WorkerDiedError(f"the loop of worker {self.name} died: {self._died}"))
